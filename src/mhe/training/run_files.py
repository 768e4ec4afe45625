"""The one place that reads a run folder's files: each malformed or incomplete file
becomes a one-line :class:`MheError` naming the file and what is wrong; and the one writer
of its run record (``config.json``: :func:`write_run_record`).

A run folder holds ``config.json`` (``run``: the configuration asked for,
``model``: the resolved model configuration, ...), ``tokenizer.json``,
``metrics.jsonl`` (one JSON record per logged step), ``checkpoints/``,
``best/`` and, once finished, ``results.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from typing import TYPE_CHECKING

from mhe.errors import MheError
from mhe.training.atomic import write_json_atomic, write_text_atomic
from mhe.training.config import RunConfig, TrainConfig, from_dict

if TYPE_CHECKING:  # the configuration readers here need no torch (the CLI's settings errors come before it)
    import torch

CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"


def read_json(path: str | Path, *, what: str = "JSON file") -> object:
    """Parse ``path``; missing, unreadable or malformed files raise a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise MheError(f"{path} does not exist (a {what} was expected)")
    try:
        return parse_json(path.read_bytes(), where=path)
    except OSError as e:
        raise MheError(f"{path}: cannot be read ({e.strerror})") from e


def parse_json(data: bytes, *, where: str | Path) -> object:
    """The JSON document in ``data`` (a file's bytes, on disk or in an archive named by ``where``);
    bytes that are not UTF-8 or not JSON raise a one-line error naming ``where``."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MheError(f"{where}: not UTF-8 text (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise MheError(f"{where}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from e


def write_run_record(folder: str | Path, run: RunConfig, model: torch.nn.Module, *, train: TrainConfig,
                     device: str, **extra) -> None:
    """Write ``folder/config.json`` atomically: the configuration asked for (``run``, and its hash),
    the training settings as resolved (``train``: epochs turned into steps), the model's resolved
    configuration, its attention parameter count, the torch version, the card (``device``) and
    ``extra`` entries (a converted run: where it came from)."""
    import torch

    from mhe.accounting import count_attention_params

    write_json_atomic(Path(folder) / CONFIG, {
        "run": run.record(), "resolved_train": dataclasses.asdict(train), "model": model.cfg.to_dict(),
        "config_hash": run.hash(), "attention_params": count_attention_params(model), "torch": torch.__version__,
        "device": device, **extra})


def run_config_from_dict(d: object, *, source: str | Path, options_of: Callable[[str], type]) -> RunConfig:
    """A :class:`RunConfig` from its dictionary, or a one-line error naming ``source``;
    ``options_of`` maps the task's name to the class of its options (``mhe.tasks.options_of``)."""
    if not isinstance(d, dict):
        raise MheError(f"{source}: a run configuration must be a JSON object, got {type(d).__name__}")
    try:
        options = options_of(d.get("task")) if isinstance(d.get("task"), str) else None
        return from_dict(d, options)  # checks every key and value
    except MheError as e:
        raise MheError(f"{source}: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise MheError(f"{source}: not a valid run configuration ({e})") from e


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


CHECKPOINTS = "checkpoints"


def locate_run(path: str | Path, option: str = "--run") -> tuple[Path, Path | None]:
    """(run folder, checkpoint folder or None) of ``path``, a run folder or one of its
    checkpoints (``RUN/checkpoints/step-N``); anything else is a one-line error in the words
    every command uses."""
    path = Path(path)
    if not path.exists():
        raise MheError(f"{option} {path} does not exist")
    if path.parent.name == CHECKPOINTS and is_run_dir(path.parent.parent) and path.is_dir():
        return path.parent.parent, path
    if not is_run_dir(path):
        raise MheError(f"{option} {path} is not a run folder: pass the folder that holds {CONFIG}")
    return path, None


def require_run_dir(path: str | Path, option: str = "--run") -> Path:
    """The run folder ``path`` names (itself, or the run of a checkpoint folder in it)."""
    return locate_run(path, option)[0]


def read_run_record(run_dir: str | Path) -> dict:
    """``run_dir/config.json`` as a dictionary with a valid ``run`` and a ``model`` object."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise MheError(f"{run_dir} is not a run folder: pass the folder that holds {CONFIG}")
    record = read_json(path, what="run configuration")
    if not isinstance(record, dict):
        raise MheError(f"{path}: must be a JSON object, got {type(record).__name__}")
    for key in ("run", "model"):
        if not isinstance(record.get(key), dict):
            raise MheError(f"{path}: no {key!r} object (truncated or not written by mhe)")
    return record


def read_run_config(run_dir: str | Path, options_of: Callable[[str], type]) -> RunConfig:
    """The configuration a run was started with (``options_of``: as :func:`run_config_from_dict`)."""
    return run_config_from_dict(read_run_record(run_dir)["run"], source=Path(run_dir) / CONFIG, options_of=options_of)


def read_results(run_dir: str | Path) -> dict:
    path = Path(run_dir) / RESULTS
    res = read_json(path, what="results file")
    if not isinstance(res, dict):
        raise MheError(f"{path}: must be a JSON object, got {type(res).__name__}")
    return res


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl``; a torn last line (a write cut by a kill) is dropped,
    any other line that is not a record with a ``step`` is an error."""
    path = Path(path)
    if not path.exists():
        return []
    return parse_metrics(path.read_bytes(), where=path)


def parse_metrics(data: bytes, *, where: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl``'s bytes (on disk or in an archive named by ``where``),
    as :func:`read_metrics` reads them."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MheError(f"{where}: not UTF-8 text (byte {e.start})") from e
    lines = text.split("\n")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # no newline after it: the process died while writing it
                break
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise MheError(f"{where} line {n}: not a metrics record with an integer 'step': {line[:60]!r}")
        records.append(rec)
    return records


def truncate_metrics(path: str | Path, step: int) -> int:
    """Drop the records logged after ``step`` (the checkpoint being resumed), so no step
    appears twice; returns how many were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    records = read_metrics(path)
    keep = [r for r in records if r["step"] <= step]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))
    return len(records) - len(keep)


def append_metrics(path: str | Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def differences(there: dict, now: dict, prefix: str = "") -> str:
    """``key: X there, Y now`` for every leaf where two nested dicts differ, joined by ``; ``."""
    out = []
    for k in sorted(set(there) | set(now)):
        a, b = there.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            if d := differences(a, b, f"{prefix}{k}."):
                out.append(d)
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} there, {b!r} now")
    return "; ".join(out)
