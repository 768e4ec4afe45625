"""Distillation of a teacher's logits while a language model trains (``train.distill_from``).

Uptraining a converted model (``mhe convert``, then ``mhe pretrain --init-from``) can learn from
the model it was converted from as well as from the corpus: the teacher (a run folder, e.g. the
source MHA run) is loaded frozen and in eval mode, and every training batch is also scored by the
Kullback-Leibler divergence of the model's next-token distribution from the teacher's, both
softened by a temperature T (Hinton et al. 2015):

    loss = (1 - w) * CE(model) + w * T^2 * KL(softmax(teacher / T) || softmax(model / T)),

the KL summed over the vocabulary and averaged over the positions the cross-entropy scores, and
T^2 keeping the gradient's scale independent of T. ``train.distill_weight`` is w (0: no
distillation term), ``train.distill_temperature`` is T. The teacher must share the run's tokenizer
(its ``tokenizer.json``; a converted run and the run it came from do), so its logits mean the same
ids. The evaluations score the model alone (the cross-entropy's perplexity).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mhe.errors import MheError
from mhe.models.losses import IGNORE, causal_lm_loss
from mhe.training.checkpoint import latest_checkpoint
from mhe.training.run_files import require_run_dir
from mhe.training.weights import load_weights


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, *, weight: float,
                 temperature: float) -> torch.Tensor:
    """The training loss of the module docstring for ``logits`` and ``teacher_logits`` ``[B, T, V]``
    of ``labels`` ``[B, T]`` (the inputs themselves: position t is scored on token t+1; -100 ignored),
    in float32."""
    ce = causal_lm_loss(logits, labels)
    if weight == 0:
        return ce
    keep = labels[:, 1:] != IGNORE  # [B, T-1]
    s = F.log_softmax(logits[:, :-1][keep].float() / temperature, -1)  # [N, V]
    t = F.log_softmax(teacher_logits[:, :-1][keep].float() / temperature, -1)
    kl = (t.exp() * (t - s)).sum(-1).mean() if s.shape[0] else s.sum()
    return (1 - weight) * ce + weight * temperature ** 2 * kl


def load_teacher(run_dir: str | Path, out: Path, build, read_config) -> nn.Module:
    """The teacher of ``train.distill_from``: the run folder's newest checkpoint in a model built by
    ``build(its RunConfig)``, frozen and in eval mode. Refused (one line) unless it is a language
    model run whose ``tokenizer.json`` is the training run's own (``out/tokenizer.json``)."""
    run_dir = require_run_dir(run_dir, "train.distill_from")
    cfg = read_config(run_dir)
    if cfg.task != "lm":
        raise MheError(f"train.distill_from={run_dir} is a {cfg.task!r} run; the teacher must be a language model "
                       "run (task lm)")
    mine, theirs = out / "tokenizer.json", run_dir / "tokenizer.json"
    if not theirs.is_file() or not mine.is_file() or json.loads(mine.read_text()) != json.loads(theirs.read_text()):
        raise MheError(f"train.distill_from={run_dir} has another tokenizer than this run; the teacher must share "
                       "it (e.g. the run this one was converted from)")
    point = latest_checkpoint(run_dir / "checkpoints", report=lambda _: None)
    if point is None:
        raise MheError(f"train.distill_from={run_dir} has no complete checkpoint under checkpoints/")
    model = build(cfg)
    load_weights(point, model)
    model.requires_grad_(False)
    return model.eval()


class Distiller:
    """The teacher and the settings, as :meth:`mhe.tasks.lm.CausalLMTask.loss` uses them."""

    def __init__(self, teacher: nn.Module, weight: float, temperature: float) -> None:
        self.teacher, self.weight, self.temperature = teacher, weight, temperature

    def loss(self, model, x: torch.Tensor) -> torch.Tensor:
        """The loss of token blocks ``x`` ``[B, T]`` through ``model`` (module docstring)."""
        if self.teacher.training:  # a caller's model.train() must not reach it (it is no submodule)
            self.teacher.eval()
        with torch.no_grad():
            teacher_logits = self.teacher(x).logits
        logits = model(x).logits
        return distill_loss(logits, teacher_logits, x, weight=self.weight, temperature=self.temperature)
