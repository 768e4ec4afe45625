"""``mhe bench --sections train``: the training step of each preset (default gpt2-base and bert-base;
``--preset llama-135m`` for one), two ways in one
table, so that the figure a user reads and the speed a user gets cannot drift apart:

* ``step``: the step alone on a fixed batch already on the device: the task's loss through the
  model (padded vocabulary and chunked cross-entropy under bf16, as training does), backward,
  clipping, the fused AdamW step, optionally compiled (``--compile``);
* ``mhe pretrain``: the trainer itself (:class:`~mhe.training.loop.Trainer`), with its data
  pipeline, loss, optimiser and log, for a few steps with every default setting (on a GPU:
  compiled, padded, prefetched), on random token blocks (or ``data``, a corpus ``mhe pretrain``
  reads); the figure is the median of the step times it logs after the first interval (which
  holds the compilation), as input tokens per second (``B x T`` a step, for MLM too, whose log
  counts the masked tokens). Evaluation is left out; nothing else is.

MFU is model FLOPs (:func:`~mhe.bench.common.flops_per_token`) x tokens/s over the card's dense
bf16 peak.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from mhe.bench.common import SMOKE_SIZES, bench_config, device_peak, flops_per_token, model_shape, timed
from mhe.models import build_model
from mhe.models import preset as model_preset
from mhe.models.vocab_padding import pad_optimizer_state, pad_vocabulary, padding_numel
from mhe.tasks import build_task
from mhe.tasks.lm import CausalLMTask
from mhe.tasks.mlm import MaskedLMTask, masked_positions, masked_rows, mask_tokens
from mhe.training.config import TrainConfig, compile_wanted, validate
from mhe.tasks import build_run
from mhe.training.loop import Trainer
from mhe.training.optim import build_optimizer
from mhe.training.run_files import read_metrics, read_results
from mhe.training.parallelize import compile_model as compile_step


def real_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) - padding_numel(model)


def isolated_step(preset: str, kind: str, *, dev: torch.device, B: int, T: int, steps: int, warmup: int,
                  compile_model: bool, small: bool, pad_vocab: bool) -> dict:
    """Median time of the training step alone (see the module docstring)."""
    cuda = dev.type == "cuda"
    model = build_model(bench_config(preset, kind, small=small, max_len=max(T, 512))).to(dev)
    if pad_vocab and cuda:
        pad_vocabulary(model)
    opt, _ = build_optimizer(model, TrainConfig(lr=1e-4, warmup_steps=0))
    pad_optimizer_state(opt, model)
    graphs = compile_model and cuda  # as the trainer runs fixed-shape pre-training (cuda_graphs_wanted)
    net = compile_step(model, graphs) if compile_model else model
    cfg = model.cfg
    ids = torch.randint(4, cfg.vocab_size, (B, T))
    if cfg.arch == "decoder":
        args = dict(labels=ids.to(dev), return_logits=False)
    else:  # BERT's masking, the head on the masked rows only (as the MLM task feeds it)
        ids, labels = mask_tokens(ids, mask_id=3, vocab_size=cfg.vocab_size, special=torch.arange(4))
        pos = masked_positions(labels, masked_rows(ids.numel()) if compile_model else None)
        args = dict(labels=labels.to(dev), masked_positions=pos.to(dev))
    ids = ids.to(dev)

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = net(ids, **args).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    ms = timed(step, warmup=warmup, reps=steps, cuda=cuda)
    row = _row(preset, kind, "step", cfg, real_params(model), B * T / (ms / 1000), T, dev)
    row.update(step_ms=ms, peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None)
    return row


class _RandomBlocks:
    """A pre-training task on random token blocks: the task's own collate and loss, no corpus."""

    def check(self, cfg):  # random tokens: no corpus or data folder to look for
        pass

    def setup(self, cfg, out, dist):
        g = torch.Generator().manual_seed(0)
        model = build_model(cfg.model)
        seq = cfg.data.seq_len or model.cfg.max_len
        n = 64 * cfg.train.batch_size
        self.cfg, self.max_len, self.seq_len = cfg, model.cfg.max_len, seq
        if isinstance(self, MaskedLMTask):
            self.vocab, (self.cls, self.sep, self.mask_id) = model.cfg.vocab_size, (1, 2, 3)
            self.special = torch.arange(4)
            self.static = compile_wanted(cfg.train, dist.device)  # as MaskedLMTask.setup decides
            self.blocks = self._pack(torch.randint(4, self.vocab, (n * (seq - 2),), generator=g), seq)
        else:
            self.blocks = torch.randint(0, model.cfg.vocab_size, (n, seq), generator=g)
        return model

    def evaluate(self, model):
        return {self.metric: 0.0}

    def final(self, model):
        return {"score": 0.0}


class RandomLM(_RandomBlocks, CausalLMTask):
    pass


class RandomMLM(_RandomBlocks, MaskedLMTask):
    pass


def trainer_config(preset: str, kind: str, *, dev: torch.device, B: int, T: int, steps: int, log_every: int,
                   small: bool, data: str = "", data_dir: str = ""):
    """``(task name, RunConfig)`` of :func:`user_path`'s run: ``mhe pretrain``'s defaults for
    ``preset`` and ``kind`` with the bench's steps, batch and sizes set as typed values."""
    task_name = "lm" if model_preset(preset).arch == "decoder" else "mlm"  # as mhe pretrain chooses
    cfg = build_run(task_name, preset, attention=kind, data=data, data_dir=data_dir)
    t = cfg.train  # typed values set as values (no --set text to parse again)
    t.steps, t.epochs, t.batch_size, t.log_every, t.device = steps, 0.0, B, log_every, dev.type
    t.save_every = t.eval_every = t.warmup_steps = 0
    t.keep_checkpoints = t.progress = False
    cfg.data.seq_len = T
    sizes = {"max_len": max(T, 512), **(SMOKE_SIZES if small else {})}
    if small and cfg.model.spec.grouped:  # GQA: 2 K/V heads in the smoke sizes (as bench_config)
        sizes["attn_options"] = replace(cfg.model.attn_options, n_kv_heads=2)
    cfg.model = cfg.model.replace(**sizes)
    validate(cfg)
    return task_name, cfg


def user_path(preset: str, kind: str, *, dev: torch.device, B: int, T: int, steps: int, log_every: int,
              small: bool, data: str = "", data_dir: str = "") -> dict:
    """``mhe pretrain``'s trainer for ``steps`` steps with its defaults; its median logged rate."""
    task_name, cfg = trainer_config(preset, kind, dev=dev, B=B, T=T, steps=steps, log_every=log_every, small=small,
                                    data=data, data_dir=data_dir)
    task = build_task(task_name) if data else (RandomLM() if task_name == "lm" else RandomMLM())
    if data:  # the timing needs no evaluation
        task.evaluate, task.final = (lambda model: {task.metric: 0.0}), (lambda model: {"score": 0.0})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        Trainer(cfg, task, out, log=lambda *_: None).fit()
        records = [r for r in read_metrics(out / "metrics.jsonl") if "tokens_per_s" in r]
        n_params = read_results(out)["total_params"]
    step_s = statistics.median(r["step_s"] for r in (records[1:] or records))  # after the compiling interval
    row = _row(preset, kind, "mhe pretrain", cfg.model, n_params, B * T / step_s, T, dev)  # input tokens (MLM too)
    memory = [r["max_mem_gib"] for r in records if "max_mem_gib" in r]
    row.update(step_ms=1000 * step_s, peak_mem_gib=max(memory) if memory else None)
    return row


def _row(preset, kind, path, cfg, n_params, tok_s, T, dev) -> dict:
    peak = device_peak(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    mfu = flops_per_token(n_params, cfg, T) * tok_s / peak if peak else None
    return {"preset": preset, "kind": kind, "path": path, "shape": model_shape(cfg), "tokens_per_s": tok_s, "mfu": mfu}


def bench_training(kinds, presets, *, dev, B, T, steps, warmup, compile_model, small, pad_vocab=True,
                   trainer_steps=60, log_every=10, data="", data_dir="") -> list[dict]:
    """For every preset and kind: the isolated step, then ``mhe pretrain``'s step."""
    rows = []
    for preset in presets:
        for kind in kinds:
            rows.append(isolated_step(preset, kind, dev=dev, B=B, T=T, steps=steps, warmup=warmup,
                                      compile_model=compile_model, small=small, pad_vocab=pad_vocab))
            _free(dev)
            rows.append(user_path(preset, kind, dev=dev, B=B, T=T, steps=trainer_steps, log_every=log_every,
                                  small=small, data=data, data_dir=data_dir))
            _free(dev)
    return rows


def _free(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
