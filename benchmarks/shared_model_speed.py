"""A shared MHE model in transformers beside transformers' own Llama and mhe's ``generate`` (issue 65).

    python benchmarks/shared_model_speed.py [--shapes 1x512,64x4096] [--rows ROWS] [--new 256]
        [--repeats 2] [--deadline 540] [--json PATH]
    python benchmarks/shared_model_speed.py --dry-run [--json PATH]   # a tiny model on the CPU

llama-135m's shape (30 layers, 576 wide, 9 heads of 64, SwiGLU 1,536, vocabulary 49,152, tied
embeddings), random weights, bf16 on one GPU, greedy, no stop token. A shape ``BxC`` is B prompts
of C - N random tokens and N new tokens (N = ``--new``, 256), as ``decode.py speed`` and ``mhe
bench``'s generate rows count a context. Rows (``--rows``, comma-separated):

* ``exported-static``: ``build_model("llama-135m", attention="mhe-mul")`` written by
  :func:`mhe.hf.save_model` (``--format remote-code``), loaded with
  ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.bfloat16)`` in
  a Python where ``import mhe`` fails, ``generate(..., cache_implementation="static")``, which
  transformers compiles itself on a GPU (``reduce-overhead``: inductor and CUDA graphs);
* ``exported-dynamic`` (not in the default rows: slow at batch 64): the same with ``generate``'s
  default dynamic cache;
* ``llama-mha``, ``llama-gqa``: transformers' own ``LlamaForCausalLM`` of the same shape with 9 and
  3 K/V heads (its own random initialisation), static cache, compiled by transformers: its best;
* ``mhe``: the same MHE-Mul weights through mhe's own ``model.generate`` (its default step mode:
  compiled on a GPU).

Per row and shape: one call first (compilation, graph capture), then the median of ``--repeats``
calls; ms per token = the call / N (prefill included); the prefill alone = the median of calls for
one new token, and the decode step = (t_N - t_1) / (N - 1); the K/V cache's bytes summed over the
cache's tensors at the end of a call; whether transformers compiled the decode step; and whether
the exported rows' greedy tokens equal mhe's (else the first new token where they part: bf16
kernels differ, so a late parting is rounding, not an error; with random weights a weak check, such
a model mostly repeats its input: tests/hf/test_hf_remote_gpu.py checks weights moved off their
initialisation).

Each shape's transformers rows run in a subprocess of their own (fresh compile state, as a user's
first call) with ``PYTHONPATH`` empty and ``mhe`` blocked; the ``mhe`` row runs in this process.
Rows not started once ``--deadline`` seconds have passed are skipped. Prints the card, the versions
and a markdown table per shape; ``--json`` writes every figure (rewritten after each shape). ``--dry-run``: a tiny model
(2 layers, 64 wide, 4 heads; GQA with 2 K/V heads) in float64 on the CPU, shapes 1x16 and 2x24, 4
new tokens, one repeat: the same code end to end (tests/bench/test_shared_model_speed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # not from toolbox: its child must not see src
ROWS = ("exported-static", "exported-dynamic", "llama-mha", "llama-gqa", "mhe")
DEFAULT_ROWS = ("exported-static", "llama-mha", "llama-gqa", "mhe")
HF_ROWS = ROWS[:4]
TINY = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128)


# ------------------------------------------------------------------ both processes
def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(call, dev, reps: int) -> tuple[float, float, object]:
    """(seconds of the first call, median seconds of ``reps`` more, the last call's result)."""
    sync(dev)
    t0 = time.perf_counter()
    out = call()
    sync(dev)
    first, times = time.perf_counter() - t0, []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = call()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), out


def prompts(vocab: int, batch: int, context: int, new: int, dev):
    """The same random prompts in both processes (a seeded CPU generator)."""
    import torch

    g = torch.Generator().manual_seed(batch * 100003 + context)
    ids = torch.randint(1, vocab, (batch, context - new), generator=g).to(dev)
    return ids, torch.ones_like(ids)


def row_figures(first: float, sec: float, one: float, new: int) -> dict:
    return {"first_call_s": first, "seconds": sec, "prefill_ms": 1000 * one, "ms_per_token": 1000 * sec / new,
            "decode_ms_per_step": 1000 * (sec - one) / max(new - 1, 1)}


# ------------------------------------------------------------------ the subprocess: transformers only
def child(job_path: str, out_path: str) -> None:
    """The transformers rows of one shape, in a Python where mhe cannot be imported."""
    sys.modules["mhe"] = None  # before anything else: the exported folder must not reach mhe
    try:
        import mhe  # noqa: F401
        raise SystemExit("mhe is importable in the transformers process")
    except ImportError:
        pass
    import torch
    import transformers

    job = json.loads(Path(job_path).read_text())
    dev, dtype = torch.device(job["device"]), getattr(torch, job["dtype"])
    if dev.type == "cpu":
        torch.set_num_threads(int(os.environ.get("MHE_THREADS", "1")))
    out = {"mhe_importable": False, "torch": torch.__version__, "transformers": transformers.__version__, "rows": {}}
    for name in job["rows"]:
        if time.time() > job["stop_at"]:
            out["rows"][name] = {"skipped": "deadline"}
            continue
        model = _hf_model(name, job, dev, dtype)
        out["rows"][name] = _hf_row(model, name, job, dev)
        out["rows"][name]["module"] = type(model).__module__
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        Path(out_path).write_text(json.dumps(out))
    Path(out_path).write_text(json.dumps(out))  # also when every row was skipped: never a stale shape's rows


def _hf_model(name: str, job: dict, dev, dtype):
    import torch
    import transformers

    if name.startswith("exported"):
        model = transformers.AutoModelForCausalLM.from_pretrained(job["folder"], trust_remote_code=True, dtype=dtype)
    else:
        s = job["shape"]
        cfg = transformers.LlamaConfig(
            vocab_size=s["vocab_size"], hidden_size=s["d_model"], intermediate_size=s["d_ff"],
            num_hidden_layers=s["n_layers"], num_attention_heads=s["n_heads"],
            num_key_value_heads=s["n_heads"] if name == "llama-mha" else s["n_kv_heads"],
            max_position_embeddings=s["max_len"], rms_norm_eps=s["eps"], tie_word_embeddings=True,
            attention_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    return model.to(dev, dtype).eval()


def _hf_row(model, name: str, job: dict, dev) -> dict:
    import torch

    batch, context, new = job["batch"], job["context"], job["new"]
    ids, mask = prompts(job["shape"]["vocab_size"], batch, context, new, dev)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
              cache_implementation=None if name == "exported-dynamic" else "static")
    with torch.no_grad():
        first, sec, res = timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw), dev,
                                job["repeats"])
        cache = res.cache if getattr(res, "cache", None) is not None else getattr(res, "past_key_values", None)
        row = {"cache_bytes": sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers),
               "compiled": hasattr(model, "_compiled_call"), "tokens": res.sequences[:, -new:].tolist()}
        _, one, _ = timed(lambda: model.generate(ids, max_new_tokens=1, **kw), dev, job["repeats"])
    return {**row_figures(first, sec, one, new), **row}


# ------------------------------------------------------------------ this process: mhe
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x512,64x4096", help="BATCHxCONTEXT,... (context = prompt + new)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--new", type=int, default=256, help="new tokens per call")
    p.add_argument("--repeats", type=int, default=2, help="timed calls after the first")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds; rows not started by then are skipped")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--dry-run", action="store_true", help="a tiny float64 model on the CPU, shapes 1x16,2x24")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(argv)
    if args.dry_run:
        args.shapes, args.new, args.repeats = ("1x16,2x24" if args.shapes == p.get_default("shapes") else args.shapes,
                                               4, 1)
    return p, args


def shapes_of(p, text: str, new: int) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            b, c = (int(x) for x in part.lower().split("x"))
        except ValueError:
            p.error(f"--shapes: {part!r} is not BATCHxCONTEXT (e.g. 1x512)")
        if b < 1 or c <= new:
            p.error(f"--shapes: {part!r} needs a batch of at least 1 and a context above --new ({new})")
        out.append((b, c))
    return out


def build_mhe(args, max_len: int):
    """The MHE-Mul model (random weights, seed 0) on the card, and the shape for transformers' Llama."""
    import torch

    from mhe.models import build_model

    torch.manual_seed(0)
    size = TINY if args.dry_run else {}
    preset = "llama-tiny" if args.dry_run else "llama-135m"
    dev = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float64 if args.dry_run else torch.bfloat16
    model = build_model(preset, attention="mhe-mul", max_len=max_len, **size).to(dev, dtype).eval()
    c = model.cfg
    kv = 2 if args.dry_run else 3  # llama-135m's own K/V heads (its preset's gqa setting)
    shape = dict(vocab_size=c.vocab_size, d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads, d_ff=c.d_ff,
                 n_kv_heads=kv, max_len=max_len, eps=c.layer_norm_eps)
    return model, shape, dev, dtype


def mhe_row(model, args, batch: int, context: int, dev) -> dict:
    import torch

    ids, mask = prompts(model.cfg.vocab_size, batch, context, args.new, dev)
    with torch.no_grad():
        first, sec, tokens = timed(lambda: model.generate(ids, args.new, attention_mask=mask), dev, args.repeats)
        _, one, _ = timed(lambda: model.generate(ids, 1, attention_mask=mask), dev, args.repeats)
    return {**row_figures(first, sec, one, args.new), "tokens": tokens[:, -args.new:].tolist()}


def run_child(job: dict, tmp: Path) -> dict:
    (tmp / "out.json").unlink(missing_ok=True)  # a shape never reads the shape before's rows
    (tmp / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp / "modules"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(tmp / "job.json"),
                           str(tmp / "out.json")], env=env, cwd=tmp, capture_output=True, text=True)
    got = json.loads((tmp / "out.json").read_text()) if (tmp / "out.json").is_file() else {"rows": {}}
    if done.returncode != 0:
        got["error"] = done.stderr[-2000:]
    return got


def parting(tokens, reference) -> str:
    """'yes', or where the greedy tokens first part from mhe's (the first new token that differs)."""
    if tokens is None or reference is None:
        return ""
    if tokens == reference:
        return "yes"
    firsts = [next(i for i, (a, b) in enumerate(zip(r, w)) if a != b) for r, w in zip(tokens, reference) if r != w]
    return f"no: from token {min(firsts)} ({len(firsts)} of {len(tokens)} rows)"


def measure(args, p) -> dict:
    import torch

    shapes = shapes_of(p, args.shapes, args.new)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        p.error(f"--rows: {', '.join(bad)} not among {', '.join(ROWS)}")
    stop_at = time.time() + args.deadline
    model, shape, dev, dtype = build_mhe(args, max(c for _, c in shapes))
    card = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    report = {"card": card, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "new": args.new,
              "repeats": args.repeats, "shape": shape, "command": " ".join(args.argv), "shapes": {}}
    from mhe.hf import save_model

    with tempfile.TemporaryDirectory(prefix="shared-model-") as tmp:
        folder = save_model(model, Path(tmp) / "exported")
        for batch, context in shapes:
            key = f"{batch}x{context}"
            job = dict(folder=str(folder), device=dev.type, dtype=report["dtype"], shape=shape, batch=batch,
                       context=context, new=args.new, repeats=args.repeats, stop_at=stop_at,
                       rows=[r for r in rows if r in HF_ROWS])
            got = run_child(job, Path(tmp)) if job["rows"] else {"rows": {}}
            report["transformers"] = got.get("transformers", report.get("transformers"))
            result = dict(got["rows"])
            if "mhe" in rows:
                result["mhe"] = mhe_row(model, args, batch, context, dev) if time.time() < stop_at else \
                    {"skipped": "deadline"}
            ref = result.get("mhe", {}).get("tokens")
            for name, row in result.items():  # the exported rows hold mhe's weights, transformers' Llama its own
                row["same_tokens_as_mhe"] = parting(row.get("tokens"), ref) if name.startswith("exported") else ""
            report["shapes"][key] = {"rows": result, "error": got.get("error"),
                                     "mhe_importable_in_child": got.get("mhe_importable")}
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))
    return report


# ------------------------------------------------------------------ the report
def table(report: dict) -> str:
    """Markdown: the setup line, then one table per shape."""
    out = [f"Card: {report['card']}; torch {report['torch']}, transformers {report.get('transformers')}; "
           f"{report['dtype']}, greedy, {report['new']} new tokens, median of {report['repeats']} calls after the "
           f"first. Command: `python benchmarks/shared_model_speed.py {report['command']}`", ""]
    for key, shape in report["shapes"].items():
        rows = shape["rows"]
        mha = rows.get("llama-mha", {}).get("cache_bytes")
        out += [f"batch x context {key} (prompt + {report['new']} new):", "",
                "| row | ms/token | decode ms/step | prefill ms | K/V cache MiB | MHA's / this | compiled | "
                "first call s | tokens = mhe's |", "|---|---:|---:|---:|---:|---:|---|---:|---|"]
        out += [_line(name, r, mha) for name, r in rows.items()]
        if shape.get("error"):
            out.append(f"\nThe transformers process failed: `{shape['error'].strip().splitlines()[-1]}`")
        out.append("")
    return "\n".join(out)


def _line(name: str, r: dict, mha: int | None) -> str:
    if "skipped" in r:
        return f"| {name} | skipped ({r['skipped']}) | | | | | | | |"
    cache = r.get("cache_bytes")
    mib = f"{cache / 2**20:.1f}" if cache else ""
    ratio = f"{mha / cache:.2f}" if cache and mha else ""
    return (f"| {name} | {r['ms_per_token']:.3f} | {r['decode_ms_per_step']:.3f} | {r['prefill_ms']:.1f} | {mib} | "
            f"{ratio} | {r.get('compiled', '')} | {r['first_call_s']:.1f} | {r['same_tokens_as_mhe']} |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(*argv[1:3])
        return 0
    import toolbox  # noqa: F401  (this checkout's src first)
    p, args = parse(argv)
    report = measure(args, p)
    print(table(report))
    return 0 if all(not s.get("error") for s in report["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
