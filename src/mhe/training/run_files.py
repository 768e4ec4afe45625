"""The one place that reads a run folder's files: each malformed or incomplete file
becomes a one-line :class:`MheError` naming the file and what is wrong.

A run folder holds ``config.json`` (``run``: the configuration asked for,
``model``: the resolved model configuration, ...), ``tokenizer.json``,
``metrics.jsonl`` (one JSON record per logged step), ``checkpoints/``,
``best/`` and, once finished, ``results.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from mhe.errors import MheError
from mhe.training.atomic import write_text_atomic
from mhe.training.config import RunConfig

CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"


def read_json(path: str | Path, *, what: str = "JSON file") -> object:
    """Parse ``path``; missing, unreadable or malformed files raise a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise MheError(f"{path}: no such {what}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise MheError(f"{path}: not UTF-8 text (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise MheError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except OSError as e:
        raise MheError(f"{path}: cannot be read ({e.strerror})") from e


def run_config_from_dict(d: object, *, source: str | Path) -> RunConfig:
    """A :class:`RunConfig` from its dictionary, or a one-line error naming ``source``."""
    if not isinstance(d, dict):
        raise MheError(f"{source}: a run configuration must be a JSON object, got {type(d).__name__}")
    try:
        return RunConfig.from_dict(d)  # checks every key and value, migrating the earlier layout
    except MheError as e:
        raise MheError(f"{source}: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise MheError(f"{source}: not a valid run configuration ({e})") from e


def read_run_config_file(path: str | Path) -> RunConfig:
    """A saved configuration on its own (``run.json``, ``mhe run --config``)."""
    return run_config_from_dict(read_json(path, what="run configuration"), source=path)


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_run_record(run_dir: str | Path) -> dict:
    """``run_dir/config.json`` as a dictionary with a valid ``run`` and a ``model`` object."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise MheError(f"{run_dir} is not a run directory (no {CONFIG})")
    record = read_json(path, what="run configuration")
    if not isinstance(record, dict):
        raise MheError(f"{path}: must be a JSON object, got {type(record).__name__}")
    for key in ("run", "model"):
        if not isinstance(record.get(key), dict):
            raise MheError(f"{path}: no {key!r} object (truncated or not written by mhe)")
    return record


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The configuration a run was started with."""
    return run_config_from_dict(read_run_record(run_dir)["run"], source=Path(run_dir) / CONFIG)


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
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MheError(f"{path}: not UTF-8 text (byte {e.start})") from e
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
            raise MheError(f"{path} line {n}: not a metrics record with an integer 'step': {line[:60]!r}")
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


def config_diff(a: dict, b: dict, prefix="") -> str:
    """Where two configurations (``RunConfig.identity()``) differ: ``key: A there, B now; ...``."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            d = config_diff(va, vb, f"{prefix}{k}.")
            if d:
                out.append(d)
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} there, {vb!r} now")
    return "; ".join(out)
