"""One configuration of ``benchmarks/train_bench.py profile``: ``mhe pretrain``'s training step set
up as :class:`~mhe.training.loop.Trainer` sets it up, timed and profiled on random token blocks.

The step is the trainer's own: the model made ready by :func:`~mhe.training.parallelize.parallelize`
(compiled where :func:`~mhe.training.config.compile_wanted` says, as on CUDA by default),
:class:`~mhe.training.prefetch.Prefetcher`, :class:`~mhe.training.step.StepWindow` and
:func:`~mhe.training.step.train_step`, with the task's own collate and loss (padded vocabulary,
chunked cross-entropy, fused AdamW, clipping). :func:`measure` compiles and warms up, times
steps in a row (wall time per step, as the trainer logs it, and the host's time to queue one),
then profiles a few with ``torch.profiler`` (:mod:`mhe.bench.profiling` reads the trace), and
reads dynamo's graphs, graph breaks and recompiles (guard failures) of the configuration.

Under ``torchrun`` every process builds and runs the same configuration (the trainer's DDP path:
``train.batch_size`` is the global batch, each process takes its share) and each step is preceded
by the trainer loop's stop-signal agreement (a gloo all-reduce, timed on its own); every process's
own figures (wall, host, agreement, GPU-busy and collective-kernel ms, dynamo's graphs, CPU
threads) are gathered to every process (:func:`gather`), the rest of the row is rank 0's.

``settings`` (an ``argparse.Namespace`` or any object) carries ``batch``, ``seq``, ``device``,
``data``, ``data_dir``, ``cpu_smoke``, ``layers`` (0: the preset's), ``warmup``, ``timed`` and
``profiled``.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mhe.attention import kernels
from mhe.bench.common import SMOKE_SIZES, device_peak, flops_per_token
from mhe.bench.profiling import by_category, kernel_times, sdpa_calls
from mhe.bench.training import RandomLM, RandomMLM, real_params
from mhe.models import preset as model_preset
from mhe.models.vocab_padding import pad_vocabulary
from mhe.settings import set_path
from mhe.tasks import build_run, build_task
from mhe.training import distributed
from mhe.training.batches import BatchOrder
from mhe.training.config import check_device, validate
from mhe.training import parallelize as wrapping
from mhe.training.prefetch import Prefetcher
from mhe.training.state import TrainerState, seed_all
from mhe.training.step import StepWindow, train_step


def run_config(preset: str, kind: str, dropout: bool, s):
    """``(task name, RunConfig)`` of one configuration: ``mhe pretrain``'s defaults for ``preset``
    and ``kind`` with the profile's sizes (``s``) set as typed values."""
    task_name = "lm" if model_preset(preset).arch == "decoder" else "mlm"  # as mhe pretrain chooses
    cfg = build_run(task_name, preset, attention=kind, data=s.data, data_dir=s.data_dir)
    # typed values set as values; only the command line's --cuda-graphs word is text, parsed once here
    cfg.train.batch_size, cfg.train.progress, cfg.train.device = s.batch, False, s.device
    set_path(cfg.train, ["cuda_graphs"], getattr(s, "cuda_graphs", "auto"), "train.cuda_graphs",
             text=isinstance(getattr(s, "cuda_graphs", "auto"), str))
    cfg.data.seq_len = s.seq
    sizes = {"max_len": max(s.seq, 512) if not s.cpu_smoke else 128}
    sizes.update({} if dropout else {"dropout": 0.0, "attn_dropout": 0.0})
    sizes.update(SMOKE_SIZES if s.cpu_smoke else {})
    sizes.update({"n_layers": s.layers} if getattr(s, "layers", 0) else {})
    cfg.model = cfg.model.replace(**sizes)
    validate(cfg)
    check_device(cfg.train.device)
    return task_name, cfg


def build(preset: str, kind: str, dropout: bool, s, out: Path) -> dict:
    """The trainer's step objects for one configuration, set up as ``Trainer._build`` does."""
    task_name, cfg = run_config(preset, kind, dropout, s)
    task = build_task(task_name) if s.data else (RandomLM() if task_name == "lm" else RandomMLM())
    t, dist = cfg.train, distributed.setup(cfg.train.device)
    seed_all(t.seed)
    model = task.setup(cfg, out, dist).to(dist.device)
    cuda = dist.device.type == "cuda"
    if cuda:
        pad_vocabulary(model)
    ready = wrapping.parallelize(model, t, dist, static_shapes=task.static_shapes, note=print if dist.main else _quiet)
    opt, sched = ready.optimizer(t)
    order = BatchOrder(task.n_train_items(), t.batch_size, seed=t.seed, rank=dist.rank, world=dist.world)
    state = TrainerState(opt, sched, order)
    data = Prefetcher(order, task.collate, dist.device, ahead=cuda)
    return dict(cfg=cfg, task=task, dist=dist, model=model, state=state, step=ready.step, data=data, window=StepWindow())


def _quiet(*_) -> None:
    pass


def gather(d: distributed.Dist, obj) -> list:
    """``obj`` of every process, by rank (host-side, over gloo: no wait for the device)."""
    if d.world == 1:
        return [obj]
    out = [None] * d.world
    torch.distributed.all_gather_object(out, obj, group=d.host_group)
    return out


def from_main(d: distributed.Dist, obj):
    """Rank 0's ``obj`` on every process (decisions that every process must take alike)."""
    if d.world == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, group=d.host_group)
    return box[0]


def _steps(h: dict, n: int) -> tuple[list[float], list[float]]:
    """Run ``n`` trainer steps as the trainer's loop does (the stop-signal agreement, then the
    step); the host's seconds to queue each step, and each agreement's seconds."""
    host, agree = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        h["dist"].agreed_signal(None)
        t1 = time.perf_counter()
        train_step(h["step"], h["data"], h["state"], h["task"], h["cfg"].train, h["dist"], h["window"])
        host.append(time.perf_counter() - t1)
        agree.append(t1 - t0)
    return host, agree


def _sync(h: dict) -> None:
    if h["dist"].device.type == "cuda":
        torch.cuda.synchronize()
    h["window"].read(h["dist"], lambda step, what, v: RuntimeError(f"non-finite {what} {v} at step {step}"))


def _fresh(cuda: bool) -> None:
    torch._dynamo.reset()  # no configuration inherits another's graphs (or guard failures)
    torch._dynamo.utils.counters.clear()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure(preset: str, kind: str, dropout: bool, s, out: Path, *, grouped_off_cudnn: bool = True) -> dict:
    """Compile and warm up, time ``s.timed`` steps, profile ``s.profiled``. ``grouped_off_cudnn``:
    :data:`mhe.attention.kernels.GROUPED_GRAD_OFF_CUDNN` for this configuration (False: SDPA's own
    backend for grouped K/V heads, the step as it was before that rule)."""
    cuda = s.device == "cuda"
    _fresh(cuda)
    kept, kernels.GROUPED_GRAD_OFF_CUDNN = kernels.GROUPED_GRAD_OFF_CUDNN, grouped_off_cudnn
    try:
        t0 = time.perf_counter()
        h = build(preset, kind, dropout, s, out)
        _steps(h, s.warmup)
        _sync(h)
        compile_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        host, agree = _steps(h, s.timed)
        _sync(h)
        wall = (time.perf_counter() - t1) / s.timed
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            _steps(h, s.profiled)
            _sync(h)
    finally:
        kernels.GROUPED_GRAD_OFF_CUDNN = kept
    times = kernel_times(prof, s.profiled)
    c, failures = torch._dynamo.utils.counters, getattr(torch._dynamo.utils, "guard_failures", {})
    cfg, model, d = h["cfg"].model, h["model"], h["dist"]
    tok_s = s.batch * s.seq / wall  # s.batch is the global batch: tokens per second over all processes
    peak = device_peak(torch.cuda.get_device_name()) * d.world if cuda else None
    categories = by_category(times)
    own = {"rank": d.rank, "wall_ms": 1000 * wall, "host_ms": 1000 * statistics.median(host),
           "agree_ms": 1000 * statistics.median(agree), "busy_ms": sum(ms for ms, _ in times.values()),
           "comm_ms": categories["communication"], "graphs": int(c["stats"]["unique_graphs"]),
           "threads": torch.get_num_threads()}
    return {"preset": preset, "kind": kind, "dropout": dropout, "grouped_off_cudnn": grouped_off_cudnn,
            "layers": cfg.n_layers, **own, "world": d.world, "per_process": gather(d, own),
            "kernels": sum(n for _, n in times.values()),
            "tokens_per_s": tok_s, "mfu": flops_per_token(real_params(model), cfg, s.seq) * tok_s / peak if peak else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
            "sdpa": sdpa_calls(prof, s.profiled), "categories": categories, "compile_s": compile_s,
            "graph_breaks": int(sum(c["graph_break"].values())),
            "recompiles": sum(len(v) for v in failures.values()),
            "top": sorted(((ms, n, k) for k, (ms, n) in times.items()), reverse=True)[:30]}
