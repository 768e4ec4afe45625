"""``mhe bench``: every attention kind side by side on the current device, one table a section.

* ``attn`` (:mod:`mhe.bench.attention`): one attention sublayer, forward and forward+backward;
* ``train`` (:mod:`mhe.bench.training`): the training step of gpt2-base and bert-base at
  sequence 512, alone and as ``mhe pretrain``'s trainer runs it: tokens/s, MFU, peak memory;
* ``decode`` (:mod:`mhe.bench.attention`): one generation step against a filled KV cache;
* ``generate`` (:mod:`mhe.bench.generate`): the user's ``model.generate`` end to end, with
  Hugging Face GPT-2's ``generate`` as the peer.

Every function takes explicit arguments (the command line is read in :mod:`mhe.cli.bench`);
every time is measured by :func:`mhe.bench.common.timed`: warm-up first, CUDA events around each
call, median of the repeats. On a CPU the sections run tiny smoke sizes so CI can check them.

Names are imported on first use (PEP 562): ``mhe bench --help`` reads the kinds without torch.
"""

import importlib

_WHERE = {"bench_attention": "attention", "bench_decode": "attention", "bench_decode_attention": "attention",
          "BENCH_KINDS": "common", "SMOKE": "common", "timed": "common",
          "generate_settings": "generate", "run_generate_section": "generate", "bench_training": "training"}

__all__ = ["BENCH_KINDS", "SMOKE", "bench_attention", "bench_decode", "bench_decode_attention", "bench_training",
           "generate_settings", "run_generate_section", "timed"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
