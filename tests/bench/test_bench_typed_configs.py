"""The bench's run configurations are set as typed values, never formatted as ``--set`` text to be
parsed again in the same process; each equals the configuration the old text items gave (the
text path is the oracle here, in the test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mhe.bench.common import SMOKE_SIZES
from mhe.bench.step_profile import run_config
from mhe.bench.training import trainer_config
from mhe.tasks import build_run

CPU = torch.device("cpu")


def _text(preset, kind, items):
    task = "lm" if preset.startswith(("gpt2", "llama")) else "mlm"
    return build_run(task, preset, attention=kind, overrides=items)


@pytest.mark.parametrize("preset, kind, small", [("gpt2-base", "mha", False), ("gpt2-base", "gqa", True),
                                                 ("llama-135m", "gqa", True), ("bert-base", "mhe-mul", True),
                                                 ("llama-135m", "mhe-mul", False)])
def test_trainer_config_equals_the_text_items(preset, kind, small):
    B, T, steps, every = 4, 64, 7, 2
    items = [f"train.steps={steps}", f"train.batch_size={B}", f"train.log_every={every}", "train.save_every=0",
             "train.eval_every=0", "train.keep_checkpoints=false", "train.progress=false", "train.warmup_steps=0",
             f"data.seq_len={T}", f"model.max_len={max(T, 512)}", "train.device=cpu"]
    if small:
        gqa = kind == "gqa"
        items += ["model.attn_options.n_kv_heads=0"] * gqa + [f"model.{k}={v}" for k, v in SMOKE_SIZES.items()]
        items += ["model.attn_options.n_kv_heads=2"] * gqa
    _, typed = trainer_config(preset, kind, dev=CPU, B=B, T=T, steps=steps, log_every=every, small=small)
    assert typed.to_dict() == _text(preset, kind, items).to_dict()


@pytest.mark.parametrize("preset, kind, dropout, smoke, layers, graphs", [
    ("gpt2-base", "mha", True, False, 0, "auto"), ("gpt2-base", "mhe-mul", False, True, 0, "false"),
    ("gpt2-base", "gqa", False, True, 3, "true"), ("llama-135m", "gqa", False, False, 2, "false"),
    ("bert-base", "sha", True, False, 2, "auto")])
def test_step_profile_config_equals_the_text_items(preset, kind, dropout, smoke, layers, graphs):
    s = SimpleNamespace(batch=4, seq=64, device="cpu", cuda_graphs=graphs, cpu_smoke=smoke, layers=layers,
                        data="", data_dir="")
    items = [f"train.batch_size={s.batch}", f"data.seq_len={s.seq}", "train.progress=false",
             f"model.max_len={max(s.seq, 512) if not s.cpu_smoke else 128}", f"train.device={s.device}",
             f"train.cuda_graphs={s.cuda_graphs}"]
    items += [] if dropout else ["model.dropout=0", "model.attn_dropout=0"]
    items += [f"model.{k}={v}" for k, v in SMOKE_SIZES.items()] if s.cpu_smoke else []
    items += [f"model.n_layers={s.layers}"] if s.layers else []
    _, typed = run_config(preset, kind, dropout, s)
    assert typed.to_dict() == _text(preset, kind, items).to_dict()
