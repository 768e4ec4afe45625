"""``convert_run``: a source (run folder or Hugging Face directory) in, a converted run folder
out, with the score of both models on a held-out split before any training.

The converted folder is a run folder at step 0: ``config.json`` (the source run's configuration
with the new kind), ``tokenizer.json`` (the source's), ``checkpoints/step-00000000`` (the weights
alone: ``pretrain --init-from`` starts a fresh optimiser on them, as does a run resumed there)
and ``conversion.json`` (the report). It is written in a temporary folder and renamed into
place, so it exists whole or not at all.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mhe.attention.spec import AttentionSpec
from mhe.convert.model import check_conversion, convert_model
from mhe.convert.options import SPLITS, target_spec
from mhe.convert.outputs import OutputFit, record_sublayers
from mhe.convert.report import ConversionReport
from mhe.convert.sources import Source, data_task, load_source
from mhe.convert.stats import input_stats
from mhe.data.tokenize import save_tokenizer
from mhe.errors import MheError
from mhe.output_paths import check_output_dir, free_name
from mhe.training.atomic import TMP_PREFIX, new_temp_folder, write_json_atomic
from mhe.training.checkpoint import save_weights
from mhe.training.config import RunConfig, option_device
from mhe.training.run_files import write_run_record



@dataclass
class ConvertOptions:
    """What ``mhe convert`` asks for: the target (``kind``, the target's spec, a name given in code
    parsed into it once; ``n_kv_heads``, ``options``, ``align``, ``naive``, ``output_fit``: see
    :func:`mhe.convert.convert_model`; None: the weight fit alone) and the source's options
    (:class:`Converter`)."""

    kind: AttentionSpec
    n_kv_heads: int = 0
    options: dict | None = None
    align: bool = True
    naive: bool = False
    output_fit: OutputFit | None = None
    evaluate: bool = True
    split: str = "valid"
    calibration: int = 32
    data: str = ""
    data_dir: str = ""
    device: str = "auto"
    tokenizer: str = ""

    def __post_init__(self) -> None:
        self.kind = target_spec(self.kind)


class Converter:
    """One source loaded once (its model, data, calibration statistics and score), converted to
    any number of kinds: ``mhe convert`` converts to one, ``benchmarks/uptrain.py study`` to five.

    Args:
        source_path: a run folder or a Hugging Face checkpoint directory.
        data, data_dir: the corpus to score and calibrate on (default: the run's own).
        device: where scoring and calibration run (``auto``: a GPU when there is one).
        split: the held-out split scored (``valid`` or ``test``).
        calibration: training sequences whose attention inputs calibrate the fit (0: none).
        evaluate: score the source and every converted model on ``split``.
        tokenizer: for a Hugging Face directory, a folder or run whose tokenizer it uses.

    A Hugging Face directory with no ``data`` converts without a corpus: not scored, not
    calibrated (said through ``log``; :attr:`unscored` holds why).
    """

    def __init__(self, source_path: str | Path, *, data: str = "", data_dir: str = "", device: str = "auto",
                 split: str = "valid", calibration: int = 32, evaluate: bool = True, tokenizer: str = "",
                 log=print) -> None:
        if split not in SPLITS:
            raise MheError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        if calibration < 0:
            raise MheError(f"--calibration must be a number of sequences >= 0, got {calibration}")
        self.device = option_device(device)
        self.split, self.calibration, self.evaluate = split, calibration, evaluate
        self.src = load_source(source_path, data=data, data_dir=data_dir, tokenizer=tokenizer)
        for note in self.src.notes:
            log(note)
        self.unscored = "" if evaluate else "--no-eval"
        if not self.src.cfg.data.dataset:  # a Hugging Face directory without --data: no corpus to read
            if evaluate:
                self.unscored, self.evaluate = "no corpus given (--data)", False
            if calibration:
                log("calibration: none without a corpus (--data); the fit uses the weights alone")
                self.calibration = 0
        self._work = tempfile.TemporaryDirectory(prefix="mhe-convert-")
        self._task, self._stats, self._source_score, self._batches, self._recorded = None, None, None, None, None

    def close(self) -> None:
        self._work.cleanup()

    def __enter__(self) -> "Converter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def task(self):
        """The source's task set up on its data (read on first use)."""
        if self._task is None:
            self._task = data_task(self.src, Path(self._work.name), self.device)
        return self._task

    def batches(self) -> list:
        """The calibration batches (on the device; empty: no calibration)."""
        if self._batches is None:
            self._batches = calibration_batches(self.task, self.calibration, self.device) if self.calibration else []
        return self._batches

    def stats(self) -> dict | None:
        """The calibration statistics of every attention sublayer's input (None: no calibration)."""
        if self._stats is None and self.calibration:
            self._stats = input_stats(self.src.model.to(self.device), self.batches())
            self.src.model.cpu()
        return self._stats

    def recorded(self) -> dict:
        """Every attention sublayer's inputs and outputs on the calibration batches, as the source
        computes them (:func:`mhe.convert.outputs.record_sublayers`, on the device): recorded once,
        for every conversion with an output fit."""
        if self._recorded is None:
            try:
                self._recorded = record_sublayers(self.src.model.to(self.device), self.batches())
            finally:
                self.src.model.cpu()
        return self._recorded

    def source_score(self) -> dict | None:
        if self.evaluate and self._source_score is None:
            self._source_score = score(self.task, self.src, self.src.model, self.split, self.device)
        return self._source_score

    def convert(self, kind: str | AttentionSpec, out: str | Path | None, *, n_kv_heads: int = 0,
                options: dict | None = None, align: bool = True, naive: bool = False,
                output_fit: OutputFit | None = None) -> tuple[nn.Module, ConversionReport]:
        """The converted model and its report (scores included when evaluating); with ``out``,
        also written there as a run folder. ``options``: the target's ``model.attn_options``;
        ``output_fit``: fit each sublayer to the source's outputs too (:mod:`mhe.convert.outputs`).
        ``kind``: the target's spec (a name is parsed into it here, once)."""
        kind = target_spec(kind)
        check_conversion(self.src.model.cfg, kind, n_kv_heads, options)  # before any data is read
        out = _check_out(Path(out)) if out is not None else None
        recorded = None
        if output_fit is not None and not naive:
            output_fit.split(self.batches())  # one line before the fit when there are too few sequences
            recorded = self.recorded()
        model, report = convert_model(self.src.model, kind, n_kv_heads=n_kv_heads, options=options,
                                      calibration=self.stats(), align=align, naive=naive, output_fit=output_fit,
                                      fit_batches=self.batches(), recorded=recorded, device=self.device)
        report.options.update({"source": str(self.src.path), "origin": self.src.origin, "notes": self.src.notes})
        if self.unscored:
            report.options["not_scored"] = self.unscored
        if self.evaluate:
            report.scores = {"source": self.source_score(),
                             "converted": score(self.task, self.src, model, self.split, self.device)}
        if out is not None:
            write_run(out, self.src, model, report)
        return model, report


def convert_run(source_path: str | Path, out: str | Path, opts: ConvertOptions, *, log=print) -> ConversionReport:
    """Convert the model at ``source_path`` as ``opts`` says and write the run folder ``out``;
    returns the report (also in ``out/conversion.json``)."""
    _check_out(Path(out))
    with Converter(source_path, data=opts.data, data_dir=opts.data_dir, device=opts.device, split=opts.split,
                   calibration=opts.calibration, evaluate=opts.evaluate, tokenizer=opts.tokenizer, log=log) as conv:
        return conv.convert(opts.kind, out, n_kv_heads=opts.n_kv_heads, options=opts.options, align=opts.align,
                            naive=opts.naive, output_fit=opts.output_fit)[1]


def _check_out(out: Path) -> Path:
    check_output_dir(out, temp=f"{TMP_PREFIX}{out.name}-{os.getpid()}")  # write_run's temporary folder, tried
    if out.exists() and any(out.iterdir()):
        raise MheError(f"--out {out} is not empty; choose another --out ({free_name(out)} is free)")
    return out


def calibration_batches(task, n: int, device: torch.device, batch: int = 8) -> list:
    """The first ``n`` training sequences of the task (contiguous blocks of the training split,
    in order), in batches on ``device``: fixed, so a conversion is reproducible."""
    if n == 0:
        return []
    blocks = getattr(task, "blocks", None)
    if blocks is not None:
        return [blocks[i:i + batch].to(device) for i in range(0, min(n, blocks.shape[0]), batch)]
    items = list(range(min(n, task.n_train_items())))
    batches = []
    for i in range(0, len(items), batch):
        inputs = task.to(task.collate(items[i:i + batch]), device)
        batches.append({k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")})
    return batches


@torch.no_grad()
def score(task, src: Source, model: nn.Module, split: str, device: torch.device) -> dict:
    """The held-out score of ``model``: the sliding-window perplexity of ``split`` for a language
    model (as ``mhe eval``), else the task's own evaluation (its validation data)."""
    model = model.to(device).eval()
    try:
        if src.cfg.task == "lm":
            res = task.split_perplexity(model, split)
            return {"metric": "perplexity", "score": res["perplexity"], **res}
        res = task.evaluate(model)
        return {"metric": task.metric, "score": res[task.metric], "split": "valid", **res}
    finally:
        model.cpu()


def write_run(out: Path, src: Source, model: nn.Module, report: ConversionReport) -> Path:
    """Write the converted run folder atomically (module docstring)."""
    cfg = copy.deepcopy(src.cfg)
    cfg.model = cfg.model.replace(attention=model.cfg.spec, attn_options=model.cfg.attn_options)
    cfg = RunConfig(task=cfg.task, preset=cfg.preset, model=cfg.model, train=cfg.train, data=cfg.data)  # checked
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_folder(out.parent, out.name)
    try:
        save_tokenizer(src.tokenizer, tmp)
        write_run_record(tmp, cfg, model, train=cfg.train, device="cpu", converted_from={
            "path": str(src.path), "origin": src.origin, "attention": src.model.cfg.attention, "kind": report.kind,
            "options": report.options})
        save_weights(tmp / "checkpoints", model=model)
        write_json_atomic(tmp / "conversion.json", report.to_dict())
        if out.exists():
            out.rmdir()  # empty (checked before any work)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise MheError(f"--out {out}: the converted run could not be written ({e.strerror or e}); nothing was "
                           "left there") from None
        raise
    return out
