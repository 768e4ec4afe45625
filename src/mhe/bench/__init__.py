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
"""

from mhe.bench.attention import bench_attention, bench_decode, bench_decode_attention
from mhe.bench.common import BENCH_KINDS, SMOKE, timed
from mhe.bench.generate import generate_settings, run_generate_section
from mhe.bench.training import bench_training

__all__ = ["BENCH_KINDS", "SMOKE", "bench_attention", "bench_decode", "bench_decode_attention", "bench_training",
           "generate_settings", "run_generate_section", "timed"]
