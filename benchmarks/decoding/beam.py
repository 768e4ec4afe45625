"""Beam-search speed of the encoder-decoder, one source tree at a time, same weights in both.

Two kinds of input:

* random (the default): transformer-base (vocabulary 8000, random weights from seed 0 with
  the tied embedding scaled by 8 so that the output distributions are not near-uniform, or
  ``--weights`` saved by ``--save-weights``), ``--sentences`` random sources of 8-30 tokens in
  batches of 64 sorted by length, beam 4, alpha 0.6, max_len 100. No hypothesis ever ends.
* a trained translation run: ``--run RUN --export mt.pt`` (this tree) writes the run's weights,
  architecture, tokenizer, decoding options and the test set (sources and references, from
  ``MHE_DATA``) in a neutral file; ``--weights mt.pt`` (any tree, this one or an older one on
  PYTHONPATH) rebuilds the same model and decodes the test set through the tree's own
  ``TranslationTask.translate`` (what ``mhe translate`` and the test decoding run), in fp32
  unless ``--dtype``; ``--batch`` sets ``eval_batch`` (sentences decoded together: 64 is what
  older runs used; default: the run's).

Every source is decoded ``--passes`` times in one process (the first pass pays for capturing
the step and for cuDNN's planning); ``--compare new.pt old.pt`` prints identical hypotheses,
first- and last-pass seconds and, for a run, the BLEU of each. docs/benchmarks.md section 6
gives the command sequence.
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

ARCH_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len", "head_dim", "attn_bias",
             "activation", "norm_first", "layer_norm_eps", "positions", "tie_embeddings", "pad_id")


def sources(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 31, (n,), generator=g)
    return [torch.randint(4, vocab, (int(t),), generator=g).tolist() for t in lengths]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="decode.py beam", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--weights", default="", help="random weights (--save-weights) or a run exported by --export")
    ap.add_argument("--save-weights", default="")
    ap.add_argument("--run", default="", help="a translation run folder to --export (this tree only)")
    ap.add_argument("--export", default="", help="with --run: write weights, architecture, tokenizer, test set here")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--step-mode", default="auto")
    ap.add_argument("--compare", nargs=2, default=None)
    ap.add_argument("--kernel", default="", help="attention kernel (ModelConfig.attn_kernel; newer trees only)")
    ap.add_argument("--dtype", default="float32", help="float32 (as mhe translate) or bfloat16")
    ap.add_argument("--batch", type=int, default=0, help="exported run: eval_batch (sentences decoded together)")
    ap.add_argument("--passes", type=int, default=2, help="decode everything this many times (the first is cold)")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if a.run:
        return export(a.run, a.export)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    saved = torch.load(a.weights, weights_only=False) if a.weights else None
    if isinstance(saved, dict) and "sources" in saved:
        return decode_run(saved, a, dev)
    return decode_random(saved, a, dev)


def device_name(dev) -> str:
    return torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"


def timed(fn, dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- trained run
def export(run: str, path: str) -> None:
    """Weights, architecture, tokenizer, options and the test set of a translation run (this tree)."""
    from mhe.tasks.runs import load_run

    model, cfg, task = load_run(run, inference=True)
    src, ref = task._test()
    arch = {k: getattr(model.cfg, k) for k in ARCH_KEYS}
    if model.cfg.attention != "mha" or model.cfg.arch != "encoder-decoder":
        raise SystemExit(f"export takes an MHA encoder-decoder run, got {model.cfg.attention} {model.cfg.arch}")
    torch.save({"state_dict": {k: v.float().cpu() for k, v in model.state_dict().items()}, "arch": arch,
                "tokenizer": task.tok.to_str(), "options": dict(task.o), "sources": src, "references": ref,
                "special": {"bos": task.bos, "eos": task.eos, "pad": task.pad}}, path)
    print(f"exported {run}: {len(src)} test sentences, {sum(v.numel() for v in model.state_dict().values())} "
          f"weights, architecture {arch}")


def build_exported(saved: dict, kernel: str):
    """The exported model in this tree; an older tree without an option the run needs stops."""
    from mhe.models import build_model
    from mhe.models.config import ModelConfig

    arch = dict(saved["arch"])
    fields = ModelConfig.__dataclass_fields__
    for key, default in (("activation", "gelu"), ("attn_kernel", "sdpa")):
        if key not in fields and arch.get(key, default) != default:
            raise SystemExit(f"this tree has no {key} option; the run needs {key}={arch[key]!r}")
        if key not in fields:
            arch.pop(key, None)
    if kernel:
        arch["attn_kernel"] = kernel
    model = build_model("transformer-base", attention="mha", dropout=0.0, attn_dropout=0.0, **arch)
    model.load_state_dict(saved["state_dict"])
    return model


def decode_run(saved: dict, a, dev) -> None:
    """The test set through this tree's ``TranslationTask.translate``, ``--passes`` times."""
    from tokenizers import Tokenizer

    from mhe.tasks.translation import TranslationTask

    model = build_exported(saved, a.kernel).to(dev).eval()
    task = TranslationTask()
    task.tok = Tokenizer.from_str(saved["tokenizer"])
    task.o = dict(saved["options"], **({"eval_batch": a.batch} if a.batch else {}))
    task.bos, task.eos, task.pad = (saved["special"][k] for k in ("bos", "eos", "pad"))
    task.max_len = model.cfg.max_len
    extra = {}
    if a.dtype != "float32":
        if "dtype" not in inspect.signature(task.translate).parameters:
            raise SystemExit("this tree's translate has no dtype option")
        extra["dtype"] = a.dtype
    out: list[list[str]] = []
    n = min(a.sentences, len(saved["sources"]))  # --sentences: the first n (all 1,000 by default)
    saved = dict(saved, sources=saved["sources"][:n], references=saved["references"][:n])
    sec = [timed(lambda: out.append(task.translate(model, saved["sources"], **extra)), dev) for _ in range(a.passes)]
    same = sum(x == y for x, y in zip(out[0], out[-1]))
    print(f"{len(saved['sources'])} sentences, beam {task.o['beam']}, {a.dtype}, eval_batch {task.o['eval_batch']}"
          f"{', kernel ' + a.kernel if a.kernel else ''}: {' then '.join(f'{x:.2f}' for x in sec)} s; "
          f"passes agree on {same}; device {device_name(dev)}")
    if a.out:
        torch.save({"hyps": out[-1], "refs": saved["references"], "seconds": sec[0], "warm": sec[-1]}, a.out)


def _beam_search():
    """``beam_search`` and the searcher class of the tree on the path (older trees: no searcher)."""
    try:
        from mhe.generation.beam import BeamSearcher, beam_search
        return beam_search, BeamSearcher
    except ImportError:
        from mhe.models.generation import beam_search
        return beam_search, None


# ---------------------------------------------------------------------------------------- random weights
def decode_random(saved, a, dev) -> None:
    from mhe.models import build_model

    beam_search, searcher = _beam_search()

    torch.manual_seed(0)
    kernel = {"attn_kernel": a.kernel} if a.kernel else {}
    model = build_model("transformer-base", attention="mha", vocab_size=8000, dropout=0.0, attn_dropout=0.0, **kernel)
    if saved is not None:
        model.load_state_dict(saved)
    else:  # sharper output distributions than N(0, 0.02) gives, so near-ties do not decide the beams
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    if a.save_weights:
        torch.save(model.state_dict(), a.save_weights)
    model = model.to(dev, getattr(torch, a.dtype)).eval()
    srcs = sources(a.sentences, 8000)
    order = sorted(range(len(srcs)), key=lambda i: len(srcs[i]))
    extra = {"step_mode": a.step_mode} if "step_mode" in inspect.signature(beam_search).parameters else {}
    if searcher is not None:  # this tree's searcher keeps the captured steps across batches (older trees: the model)
        extra["searcher"] = searcher(model, step_mode=a.step_mode)
    hyps: list[torch.Tensor] = [torch.empty(0)] * len(srcs)
    sec = [timed(lambda: decode_all(model, srcs, order, hyps, dev, extra), dev) for _ in range(a.passes)]
    print(f"{len(srcs)} sentences, beam 4, {a.dtype}{', kernel ' + a.kernel if a.kernel else ''}: "
          f"{' then '.join(f'{x:.2f}' for x in sec)} s ({extra or 'old beam search'}); device {device_name(dev)}")
    if a.out:
        torch.save({"hyps": hyps, "seconds": sec[0], "warm": sec[-1]}, a.out)


def decode_all(model, srcs, order, hyps, dev, extra) -> None:
    """Decode every source in batches of 64 (hypotheses written into ``hyps``)."""
    beam_search, _ = _beam_search()

    for k in range(0, len(order), 64):
        chunk = order[k:k + 64]
        width = max(len(srcs[i]) for i in chunk)
        src = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, i in enumerate(chunk):
            src[r, :len(srcs[i])] = torch.tensor(srcs[i])
        src = src.to(dev)
        out = beam_search(model, src, src != 0, bos_id=1, eos_id=2, beam=4, max_len=100, alpha=0.6, **extra)
        for r, i in enumerate(chunk):
            row = out[r, 1:].tolist()
            row = row[:row.index(2)] if 2 in row else row
            hyps[i] = torch.tensor(row)


def compare(new: str, old: str) -> None:
    x, y = (torch.load(p, weights_only=False) for p in (new, old))
    eq = (lambda p, q: p == q) if isinstance(x["hyps"][0], str) else torch.equal
    same = sum(eq(p, q) for p, q in zip(x["hyps"], y["hyps"]))
    print(f"identical hypotheses: {same}/{len(x['hyps'])}; first pass {x['seconds']:.2f} s vs {y['seconds']:.2f} s "
          f"= {y['seconds'] / x['seconds']:.1f}x; last pass {x['warm']:.2f} s vs {y['warm']:.2f} s "
          f"= {y['warm'] / x['warm']:.1f}x")
    if "refs" in x:
        from mhe.metrics.bleu import corpus_bleu

        print(f"BLEU {corpus_bleu(x['hyps'], x['refs'])['bleu']:.2f} (first file) vs "
              f"{corpus_bleu(y['hyps'], y['refs'])['bleu']:.2f} (second)")

