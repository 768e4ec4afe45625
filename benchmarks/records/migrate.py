"""Bring run folders saved by earlier versions of mhe to today's layout, in place.

    python benchmarks/results_tools.py migrate DIR [DIR ...]

Each DIR is searched recursively. What changes:

* ``config.json`` (its ``run``) and ``run.json`` written in the earlier layout, where the
  attention kind sat beside a dict of model overrides (``"attention": "mha", "model":
  {"n_layers": 6}``): the model becomes the full model configuration the run was built
  with. Those runs were built from the presets as they were then: no attention biases, the
  exact GELU everywhere and LayerNorm epsilon 1e-5 in the encoder-decoder, so those values
  are written out (they are overrides of today's presets). The resolved ``model`` record
  gains the fields it lacked, with the same values.
* ``sweep.json`` without ``run`` (the settings every run of a comparison shares): ``run``
  is taken from the comparison's first kind's seed-0 run, as ``mhe compare`` records it.
* configuration hashes (``config_hash`` of ``config.json``, ``results.json`` and each
  checkpoint's trainer state) computed from the earlier identity layout (:func:`legacy_identity`:
  the model as its differences from the preset with the kind beside them, options as their
  non-default values, the default gradient reduction left out, whole epochs as integers)
  become today's ``RunConfig.hash()`` (the whole typed configuration). A checkpoint's hash is
  rewritten only where it is the hash its run folder recorded or the earlier layout's hash of
  that folder's configuration, so a checkpoint of another configuration stays refused;
* checkpoints whose trainer state is split over seven files (``optimizer.safetensors``,
  ``optimizer.json``, ``rng.safetensors``, ``rng.json``, ``scheduler.json``,
  ``trainer.json``): the state is written as one ``trainer.safetensors`` plus one
  ``trainer.json`` and the folder sealed again (its checksums are checked first).

Files already in today's layout are left alone, so running it twice changes nothing.
``mhe`` refuses the earlier layouts with a one-line error that names this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from mhe.models.config import preset
from mhe.tasks import run_config_from_dict
from mhe.experiments.sweep import shared_identity
from mhe.settings import nondefault
from mhe.training.atomic import MANIFEST, verify, write_json_atomic
from mhe.training.checkpoint import list_checkpoints, read_trainer_state, rewrite_trainer_state
from mhe.training.config import OPERATIONAL_TRAIN_KEYS, RunConfig


def earlier_model(d: dict) -> dict:
    """The full model configuration of an earlier-layout run dict (``attention`` beside overrides)."""
    cfg = preset(d["preset"])
    eps = 1e-5 if cfg.arch == "encoder-decoder" else cfg.layer_norm_eps
    cfg = cfg.replace(attn_bias=False, activation="gelu", layer_norm_eps=eps)  # the presets as they were
    return cfg.replace(attention=d.get("attention", "mha"), **(d.get("model") or {})).to_dict()


def is_earlier_run(d: dict) -> bool:
    return "attention" in d or "arch" not in (d.get("model") or {})


def migrate_run(d: dict, source: Path) -> dict:
    """A run dict in today's layout (checked by loading it)."""
    new = {k: v for k, v in d.items() if k != "attention"}
    new["model"] = earlier_model(d)
    run_config_from_dict(new, source=source)  # today's loader accepts it
    return new


def migrate_config(path: Path) -> bool:
    record = json.loads(path.read_text())
    if not is_earlier_run(record.get("run") or {}):
        return False
    record["run"] = migrate_run(record["run"], path)
    model = record.get("model") or {}
    record["model"] = {**{k: v for k, v in record["run"]["model"].items() if k not in model}, **model}
    write_json_atomic(path, record)
    return True


def migrate_run_file(path: Path) -> bool:
    d = json.loads(path.read_text())
    if not is_earlier_run(d):
        return False
    write_json_atomic(path, migrate_run(d, path))
    return True


def legacy_identity(cfg: RunConfig) -> dict:
    """``RunConfig.identity`` as mhe laid it out until the configuration hashes were rewritten:
    the layout from before the model was typed, kept then so that older hashes held."""
    model = cfg.model_overrides()
    if opts := nondefault(cfg.model.attn_options):
        model["attn_options"] = opts
    train = dataclasses.asdict(cfg.train)
    for k in OPERATIONAL_TRAIN_KEYS:
        train.pop(k)
    if train["grad_reduce"] == "float32":
        train.pop("grad_reduce")
    if float(train["epochs"]).is_integer():
        train["epochs"] = int(train["epochs"])
    data = dataclasses.asdict(cfg.data)
    for k in ("data_dir", "eval_batch_size", "eval_second_stride"):
        data.pop(k)
    data["task_options"] = nondefault(cfg.data.task_options)
    return {"task": cfg.task, "preset": cfg.preset, "attention": cfg.model.attention, "model": model,
            "train": train, "data": data}


def legacy_hash(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(legacy_identity(cfg), sort_keys=True).encode()).hexdigest()[:16]


def migrate_hash(path: Path) -> list[Path]:
    """Rewrite the configuration hash of the run folder of ``path`` (its config.json) where it is
    not today's: in config.json, results.json and the checkpoints that carry the recorded hash."""
    record = json.loads(path.read_text())
    if "run" not in record or is_earlier_run(record["run"]):
        return []
    cfg = run_config_from_dict(record["run"], source=path)
    stored, new = record.get("config_hash"), cfg.hash()
    if stored is None or stored == new:
        return []
    changed = [path]
    write_json_atomic(path, {**record, "config_hash": new})
    results = path.parent / "results.json"
    if results.is_file() and json.loads(results.read_text()).get("config_hash") == stored:
        write_json_atomic(results, {**json.loads(results.read_text()), "config_hash": new})
        changed.append(results)
    for point in list_checkpoints(path.parent / "checkpoints"):
        if (point / "trainer.json").is_file() and verify(point) is None:
            state = read_trainer_state(point)
            if state.get("config_hash") in (stored, legacy_hash(cfg)):
                rewrite_trainer_state(point, {**state, "config_hash": new})
                changed.append(point)
    return changed


def migrate_sweep(path: Path) -> bool:
    record = json.loads(path.read_text())
    sweep = record["sweep"]
    if "arch" in (sweep.get("run") or {}).get("model", {}):
        return False
    first = path.parent / "runs" / f"{sweep['kinds'][0]}-seed0"
    source = first / "run.json" if (first / "run.json").is_file() else first / "config.json"
    d = json.loads(source.read_text())
    d = d.get("run", d) if source.name == "config.json" else d
    shared = shared_identity(run_config_from_dict(d, source=source).identity())
    record["sweep"] = {**sweep, "run": shared}
    write_json_atomic(path, record)
    return True


def migrate_checkpoint(folder: Path) -> bool:
    if not (folder / "optimizer.safetensors").is_file():
        return False
    problem = verify(folder)
    if problem is not None:
        raise SystemExit(f"{folder}: {problem}; not migrated (resume skips it anyway)")
    rewrite_trainer_state(folder, _old_state(folder))
    return True


def _old_state(folder: Path) -> dict:
    """The trainer state of a checkpoint in the seven-file layout."""
    from safetensors.torch import load_file

    state = json.loads((folder / "trainer.json").read_text())
    meta = json.loads((folder / "optimizer.json").read_text())
    slots = {int(i): dict(v) for i, v in meta["state"].items()}
    for name, t in load_file(str(folder / "optimizer.safetensors")).items():
        idx, key = name.split("/", 1)
        slots.setdefault(int(idx), {})[key] = t
    state["optimizer"] = {"state": slots, "param_groups": meta["param_groups"]}
    state["scheduler"] = json.loads((folder / "scheduler.json").read_text())
    state["rng"] = {"tensors": load_file(str(folder / "rng.safetensors")),
                    "meta": json.loads((folder / "rng.json").read_text())}
    return state


def migrate(root: Path) -> list[Path]:
    """Migrate everything under ``root``; returns the files and folders changed."""
    changed = []
    for path in sorted(root.rglob("config.json")):
        if migrate_config(path):
            changed.append(path)
    for path in sorted(root.rglob("run.json")):
        if migrate_run_file(path):
            changed.append(path)
    for manifest in sorted(root.rglob(MANIFEST)):  # the layout first: the hash is read from the state
        if migrate_checkpoint(manifest.parent):
            changed.append(manifest.parent)
    for path in sorted(root.rglob("config.json")):
        changed += migrate_hash(path)
    for path in sorted(root.rglob("sweep.json")):  # after the runs: "run" is read from them
        if migrate_sweep(path):
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="results_tools.py migrate", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="run folders, comparison folders or folders above them")
    args = p.parse_args(argv)
    for root in args.dirs:
        if not root.is_dir():
            print(f"{root} does not exist", file=sys.stderr)
            return 2
        changed = migrate(root)
        print(f"{root}: {len(changed)} file(s) or checkpoint(s) migrated")
    return 0

