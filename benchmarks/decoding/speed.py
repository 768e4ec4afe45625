"""Decoding speed through the user API, ours beside Hugging Face's best, in one run on one card.

    python benchmarks/decode.py speed OUT [--old-src OLD/src] [--modes graph] [--kernels split-k-decode]
        [--rotary-step on|off] [--sections table,kernels]
    python benchmarks/decode.py speed OUT --cpu-smoke            # tiny sizes on a CPU, end to end

For (batch, context) in 1x512, 64x512 and 64x4096 (256 new tokens), in bf16 on the GPU:

* HF GPT-2 ``GPT2LMHeadModel.generate(..., cache_implementation="static")``, which transformers
  compiles itself for a static cache on a GPU (the row says whether it did);
* ``build_model("gpt2-base", attention=K, max_len=P+N).to("cuda", torch.bfloat16).eval()`` then
  ``model.generate(ids, N, attention_mask=mask)`` for K in ``--kinds`` (MHA, MQA, MHE-Mul; random weights,
  greedy, no stop token, prefill included; the first call, then the median of 3 calls), in the
  default step mode and in each of ``--modes`` (``step_mode=...``), and with each of ``--kernels``
  in place of the policy's decode kernel (``kernel=...``; every row names the kernel its session
  ran), and with ``--rotary-step on|off`` once more with the rotating step so set
  (``mhe.attention.kv_cache.ROTARY_STEP``, on by default; in sessions of its own; a rotary ``--preset``), with the
  decode steps alone beside it (``(t_N - t_1) / (N - 1)``, ``t_1`` the same call for one token);
* our HF adapter ``to_hf(model).generate(..., cache_implementation="static")`` for MHA and MHE-Mul
  (batch 1 and 64 at context 512);
* kernels per generated token at batch 1 for every kind in every mode (``kernels``);
* with ``--old-src``, the same ``model.generate`` rows of an older tree (``decode.py rows`` in a
  subprocess with that tree on PYTHONPATH), its kernels per token included.

Writes ``OUT/decode-speed.md`` (the tables, the targets of issue 28 read off them, the card, torch
and transformers) and ``OUT/decode-speed.json`` (every row; rewritten after each row, so a run
cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from decoding import rows as rows_mod
from decoding import speed_report as decode_report

KINDS = ("mha", "mqa", "mhe-mul")
ADAPTER_KINDS = ("mha", "mhe-mul")


def hf_peer(batch: int, context: int, new: int, run) -> dict | None:
    """HF GPT-2 with its static cache (compiled by transformers on a GPU)."""
    try:
        import transformers
    except ImportError:
        return None
    size = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512) if run.smoke else {}
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_positions=context, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **size)
    model = transformers.GPT2LMHeadModel(cfg).to(run.dev, run.dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, context - new), device=run.dev)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, eos_token_id=None, cache_implementation="static")
    with torch.no_grad():
        first, sec = rows_mod.timed(lambda: model.generate(ids, **kw), run.dev, run.reps)
    compiled = getattr(model, "_compiled_call", None) is not None
    del model
    rows_mod.release(run.dev)
    return {"path": "HF GPT-2 static", "kind": "mha", "mode": "compiled" if compiled else "not compiled",
            "first_call_s": first, "seconds": sec, "ms_per_token": 1000 * sec / new, "tokens_per_s": batch * new / sec}


def adapter_row(model, ids, mask, new: int, run) -> dict:
    """Our HF adapter's static-cache generate (the same session as model.generate's default)."""
    from mhe.hf import to_hf

    hf = to_hf(model).eval()
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              eos_token_id=None, cache_implementation="static")
    ours, used = model.generate, []
    model.generate = lambda *a, **k: used.append(1) or ours(*a, **k)  # did the fast path run?
    try:
        first, sec = rows_mod.timed(lambda: hf.generate(ids, **kw), run.dev, run.reps)
    finally:
        del model.generate
    b = ids.shape[0]
    return {"path": "HF adapter static", "mode": "our captured step" if used else "transformers' loop (fell through)",
            "first_call_s": first, "seconds": sec, "ms_per_token": 1000 * sec / new, "tokens_per_s": b * new / sec}


def kind_rows(kind: str, batch: int, context: int, run) -> list[dict]:
    """model.generate in the default mode and each of --modes; the adapter; kernels per token."""
    from mhe.generation import session as generate_module
    from mhe.generation.step import resolve_mode

    model = rows_mod.build(run.preset, kind, context, run.dev, run.dtype, run.smoke)
    ids, mask = rows_mod.prompts(model, batch, context - run.new, run.dev)
    auto = resolve_mode("auto", run.dev)
    variants = [(f"auto ({auto})", {})] + [(m, {"step_mode": m}) for m in run.modes if m != auto]
    variants += [(f"auto ({auto}), kernel {k}", {"kernel": k}) for k in run.kernels]  # a policy's alternative
    variants += [(f"auto ({auto}), rotary step {run.rotary_step}", {"rotary_step": run.rotary_step == "on"})
                 ] if run.rotary_step else []
    out = []
    for label, options in variants:
        switch = options.pop("rotary_step", None)  # None: the default's setting
        if run.smoke and options.get("step_mode") == "compile":
            options["compile_options"] = {"backend": "aot_eager"}  # a CPU smoke run: no C++ compiler needed
        with rotary_step(switch, model):
            row = {"path": "model.generate", "mode": label,
                   **rows_mod.generate_row(model, ids, mask, run.new, run.dev, run.reps, **options)}
            used = generate_module._DEFAULT[model][-1]  # the default session the calls ran in
            row["kv_mib"] = sum(c.nbytes() for c in used.caches) / 2**20
            row["kernel"] = used.plan.kernel if used.plan is not None else None
            if batch == 1 and "kernels" in run.sections:
                row.update(rows_mod.kernels_per_token(model, ids, mask, run.dev, **options))
        out.append(row)
        run.note(f"{batch}x{context} {kind} {row['mode']}: {row['ms_per_token']:.3f} ms/token")
    if kind in ADAPTER_KINDS and (context <= run.adapter_context):
        out.append(adapter_row(model, ids, mask, run.new, run))
    del model
    rows_mod.release(run.dev)
    return [{"batch": batch, "context": context, "kind": kind, **r} for r in out]


@contextlib.contextmanager
def rotary_step(on: bool, model):
    """``kv_cache.ROTARY_STEP`` set to ``on`` while one variant runs (None: left as it is), its calls
    in default sessions of their own (released before and after, so that the row pays its own
    compile even where ``on`` is the default's setting)."""
    from mhe.attention import kv_cache
    from mhe.generation.session import release_default_sessions

    was = kv_cache.ROTARY_STEP
    own = on is not None
    if own:
        release_default_sessions(model)
    kv_cache.ROTARY_STEP = was if on is None else on
    try:
        yield
    finally:
        kv_cache.ROTARY_STEP = was
        if own:
            release_default_sessions(model)


def old_rows(run) -> list[dict]:
    """The older tree's model.generate rows (subprocess with PYTHONPATH=--old-src)."""
    out = Path(run.out) / "old-tree.json"
    cmd = [sys.executable, str(Path(__file__).parents[1] / "decode.py"), "rows", str(out), "--settings",
           ",".join(f"{b}x{c}" for b, c in run.settings), "--preset", run.preset, "--new", str(run.new),
           "--reps", str(run.reps)] + (["--smoke"] if run.smoke else [])
    env = {**os.environ, "PYTHONPATH": str(Path(run.old_src).resolve())}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        run.note(f"old tree failed: {done.stderr.strip().splitlines()[-1:]}")
        return [{"path": "old tree", "error": done.stderr[-2000:]}]
    return [{"path": "old tree model.generate", "mode": "its default", **r} for r in json.loads(out.read_text())["rows"]]


class Run:
    """The settings of one run and where its output goes."""

    def __init__(self, a) -> None:
        self.smoke, self.out, self.old_src = a.cpu_smoke, a.out, a.old_src
        self.reps = 1 if a.cpu_smoke else a.reps
        self.dev = torch.device("cpu" if a.cpu_smoke or not torch.cuda.is_available() else "cuda")
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.preset, self.kinds, self.peer = a.preset, a.kinds.split(","), a.peer
        self.settings = rows_mod.parse_settings("1x24,4x24,4x48" if a.cpu_smoke else a.settings)
        self.new = 8 if a.cpu_smoke else a.new
        self.modes = [m for m in a.modes.split(",") if m]
        self.kernels = [k for k in a.kernels.split(",") if k]
        self.rotary_step = a.rotary_step
        self.sections = set(a.sections.split(","))
        self.adapter_context = 24 if a.cpu_smoke else a.adapter_context
        self.start, self.rows = time.perf_counter(), []

    def note(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.0f} s] {text}", flush=True)

    def save(self) -> None:
        Path(self.out).mkdir(parents=True, exist_ok=True)
        tmp = Path(self.out) / "decode-speed.json.tmp"
        from mhe.attention import kv_cache

        env = {**decode_report.environment(self.dev), "rotary_step": kv_cache.ROTARY_STEP}  # the default rows'
        tmp.write_text(json.dumps({"env": env, "rows": self.rows}, indent=1))
        tmp.replace(Path(self.out) / "decode-speed.json")


def measure(run: Run) -> None:
    for batch, context in run.settings:
        peer = hf_peer(batch, context, run.new, run) if run.peer else None
        if peer is not None:
            run.rows.append({"batch": batch, "context": context, **peer})
            run.note(f"{batch}x{context} HF static ({peer['mode']}): {peer['ms_per_token']:.3f} ms/token")
        for kind in run.kinds:
            try:
                run.rows += kind_rows(kind, batch, context, run)
            except Exception as e:  # noqa: BLE001  one failing row must not cost the run
                run.rows.append({"batch": batch, "context": context, "kind": kind, "path": "model.generate",
                                 "error": repr(e)[:500]})
                run.note(f"{batch}x{context} {kind} failed: {e!r}"[:300])
                rows_mod.release(run.dev)
            run.save()
    if run.old_src:
        run.rows += old_rows(run)
        run.save()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="decode.py speed", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for decode-speed.md and decode-speed.json")
    ap.add_argument("--old-src", default="", help="an older tree's src folder: its model.generate rows too")
    ap.add_argument("--modes", default="graph,compile", help="step modes measured beside the default")
    ap.add_argument("--kernels", default="", help="decode kernels measured beside the policy's, in the default "
                                                  "mode (e.g. split-k-decode: GQA at batch 1)")
    ap.add_argument("--rotary-step", choices=["on", "off"], help="rows with the rotating step so set beside the "
                                                                 "default's (kv_cache.ROTARY_STEP; a rotary --preset)")
    ap.add_argument("--sections", default="table,kernels", help="table (always), kernels (per token)")
    ap.add_argument("--settings", default="1x512,64x512,64x4096", help="BATCHxCONTEXT, comma separated")
    ap.add_argument("--adapter-context", type=int, default=512, help="the adapter's rows up to this context")
    ap.add_argument("--preset", default="gpt2-base")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the kinds of model.generate's rows")
    ap.add_argument("--no-peer", dest="peer", action="store_false", help="no HF GPT-2 row (another preset's peer)")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    run = Run(ap.parse_args(argv))
    run.note(f"device {decode_report.environment(run.dev)}")
    measure(run)
    run.save()
    text = decode_report.report(run.rows, decode_report.environment(run.dev), new=run.new)
    (Path(run.out) / "decode-speed.md").write_text(text)
    print(text)
    run.note("done")

