"""Process-wide runtime settings: how many CPU threads torch uses, and where runs keep what the
next run can reuse (:func:`cache_root`: trained tokenizers, compiled kernels).

One setting, the environment variable ``MHE_THREADS`` (threads per process), read once
by the ``mhe`` command's entry point and by every worker process of ``mhe compare``:

- ``MHE_THREADS=N`` (N >= 1): torch uses N intra-op threads;
- ``MHE_THREADS=0``: leave torch's own default (one thread per core);
- unset: ``OMP_NUM_THREADS`` if the user set it, else 1 thread on a CPU-only machine
  and torch's default where a GPU does the work.

Why 1 by default: with torch's default of one thread per core, any other process on the
machine makes the threads wait for each other. Measured on 2 cores with other work
running, 40 steps of a 2-layer width-128 decoder took 1.9-3.3 s with 1 thread and
4.1-4.4 s with 2; a 200-step run has been seen at 29.6 s vs 3 min 22 s.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

from mhe.errors import MheError

ENV = "MHE_THREADS"
CACHE_ENV = "MHE_CACHE_DIR"
CACHE_OFF = ("off", "none", "0")


def setting_threads() -> int | None:
    """``MHE_THREADS`` as an integer, None when unset; anything else is a one-line error. Needs no
    torch: the ``mhe`` command checks it for every command, also those that never import torch."""
    raw = os.environ.get(ENV, "").strip()
    if raw and not raw.isdigit():
        raise MheError(f"{ENV} must be a non-negative integer, got {raw!r}")
    return int(raw) if raw else None


def requested_threads() -> int:
    """Threads per process asked for through the environment (0 = torch's default)."""
    n = setting_threads()
    if n is not None:
        return n
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    import torch  # here, not at import: the mhe command's help and accounting start without it

    return 0 if torch.cuda.is_available() else 1


def configure_threads() -> int:
    """Apply :func:`requested_threads` to torch; returns the threads torch now uses."""
    import torch

    n = requested_threads()
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


class _ThreadsWhenTorchLoads(importlib.abc.MetaPathFinder):
    """An import hook that applies :func:`configure_threads` the moment torch finishes importing,
    then removes itself (importlib's meta path: it finds torch's spec as usual and wraps only
    its loader's ``exec_module``)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                configure_threads()

            spec.loader.exec_module = exec_module
        return spec


def configure_threads_on_import() -> None:
    """:func:`configure_threads` now if torch is imported, else as soon as it is: a command that
    stops before it needs torch (a setting's error) never imports it, and one that goes on has
    its threads set before any work."""
    if "torch" in sys.modules:
        configure_threads()
    elif not any(isinstance(f, _ThreadsWhenTorchLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _ThreadsWhenTorchLoads())


def worker_threads(workers: int) -> int:
    """Threads for each of ``workers`` processes sharing this machine: the setting,
    never more than the machine's cores divided among them (at least 1)."""
    share = max(1, (os.cpu_count() or 1) // max(1, workers))
    n = requested_threads()
    return share if n == 0 else min(n, share)


def cache_root() -> Path | None:
    """Where runs keep what a later run of the same inputs reuses: ``MHE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mhe``, else ``~/.cache/mhe``; None for ``MHE_CACHE_DIR=off`` (nothing kept).
    A path that is, or lies under, a file is a one-line error naming the setting."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    if raw.lower() in CACHE_OFF:
        return None
    if raw:
        root, setting = Path(raw).expanduser(), f"{CACHE_ENV}={raw}"
    else:
        home = os.environ.get("XDG_CACHE_HOME")
        root = Path(home or Path.home() / ".cache") / "mhe"
        setting = f"XDG_CACHE_HOME={home}" if home else f"the default cache folder {root}"
    for place in (root, *root.parents):
        if place.exists():
            if not place.is_dir():
                raise MheError(f"{setting}: {place} is a file, not a folder; give a folder (or {CACHE_ENV}=off "
                               "to keep nothing)")
            break
    return root


DIST_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` sets for every worker: all of them, or (one process) none."""


def check_launch_env() -> str:
    """A distributed launch's environment is whole or absent: ``WORLD_SIZE`` or ``RANK`` set
    without the rest of :data:`DIST_ENV` (a hand-made or leftover launch) is a one-line error
    naming what is set and what is missing, instead of torch's rendezvous traceback. A
    ``MASTER_ADDR``/``MASTER_PORT`` alone changes nothing for one process: allowed, and the
    returned note says so (empty otherwise)."""
    have = [k for k in DIST_ENV if os.environ.get(k, "").strip()]
    if len(have) == len(DIST_ENV) or not have:
        return ""
    if not {"WORLD_SIZE", "RANK"} & set(have):
        return (f"{', '.join(f'{k}={os.environ[k]}' for k in have)} set without WORLD_SIZE and RANK: one process, "
                "the address unused")
    missing = [k for k in DIST_ENV if k not in have]
    raise MheError(f"a partial distributed environment: {', '.join(f'{k}={os.environ[k]}' for k in have)} set, "
                   f"{', '.join(missing)} not; launch with torchrun (which sets {', '.join(DIST_ENV)}), or unset "
                   f"{', '.join(have)} to run one process")


def configure_compile_cache() -> str | None:
    """Keep ``torch.compile``'s on-disk caches on and across runs: inductor's FX graph cache and AOT
    autograd's cache (a run that compiles the graphs an earlier run compiled loads the kernels
    instead), in ``cache_root()/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set (inductor's own
    default is a temporary folder, which machines clear). Settings the user gave through
    ``TORCHINDUCTOR_FX_GRAPH_CACHE`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE`` are kept. Dynamo's tracing and
    the capture of CUDA graphs are not cached by torch: they are paid by every run. Returns the folder."""
    root = cache_root()
    if root is not None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    if "TORCHINDUCTOR_FX_GRAPH_CACHE" not in os.environ:
        inductor_config.fx_graph_cache = True
    if "TORCHINDUCTOR_AUTOGRAD_CACHE" not in os.environ and hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def launched_rank() -> int:
    """This process's rank as ``torchrun`` set it (0 when not launched by it)."""
    return int(os.environ.get("RANK", "0"))
