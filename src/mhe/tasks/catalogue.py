"""Every task's settings, without torch: :data:`CATALOGUE` maps a task's name to the settings half
of its class (:mod:`mhe.tasks.settings`, :class:`mhe.tasks.finetune_config.FinetuneSettings`: its
command, summary, options and default run), and the functions that build a run's configuration
and read saved ones from it. ``mhe train --help`` lists the tasks, and every command checks its
settings (``--set``), before torch is imported; :data:`mhe.tasks.registry.TASKS` holds the task
classes themselves, each a subclass of its entry here (checked there).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from mhe.attention.spec import AttentionSpec
from mhe.errors import MheError, one_of
from mhe.models.config import preset as get_preset
from mhe.settings import set_path
from mhe.tasks.finetune_config import FinetuneSettings
from mhe.tasks.settings import LMSettings, MLMSettings, RecallSettings, TranslationSettings
from mhe.training import run_files
from mhe.training.config import RunConfig, apply_overrides
from mhe.training.task import Task

CATALOGUE: dict[str, type[Task]] = {"lm": LMSettings, "mlm": MLMSettings, "recall": RecallSettings,
                                    "mt": TranslationSettings, "finetune": FinetuneSettings}


def train_tasks() -> list[str]:
    """The tasks ``mhe train`` runs (the others have their own command)."""
    return [name for name, entry in CATALOGUE.items() if entry.command == "train"]


def settings_class(name: str) -> type[Task]:
    """The settings of task ``name`` (one of :data:`CATALOGUE`)."""
    if name not in CATALOGUE:
        raise one_of("task", name, CATALOGUE)
    return CATALOGUE[name]


def options_of(name: str) -> type:
    """The class of task ``name``'s ``data.task_options``."""
    return settings_class(name).options


def default_run(task: str, preset: str, attention: str | AttentionSpec = "mha", dataset: str = "") -> RunConfig:
    """The task's default run for a model preset, attention kind (its spec, or its name) and data
    set (``Task.default_config``)."""
    return settings_class(task).default_config(preset, attention=attention, dataset=dataset)


def build_run(task: str, preset: str, *, attention: str = "mha", data: str = "", data_dir: str = "",
              seed: int | None = None, overrides: Sequence[str] = (), task_options: dict | None = None,
              flags: dict[str, tuple[str, object]] | None = None) -> RunConfig:
    """A run's typed configuration as the training commands build it: the task's defaults, then
    the attention kind, the data folder, the seed, the task options and every ``--set`` item
    (in that order, so a ``--set`` item wins), all checked before anything is read or written.
    The run starts from the preset's own kind, so a kind of the same family keeps the preset's
    options (``--preset llama-135m --attention gqa``: its 3 K/V heads). Typed values are set as
    values; only the ``--set`` items are text.

    ``flags``: the settings the command line's options gave explicitly (key -> the option and its
    value, e.g. ``{"train.seed": ("--seed", 3)}``); a ``--set`` item of the same key that ends at
    another value is refused, naming both (:func:`check_flags_agree`)."""
    cfg = default_run(task, preset, get_preset(preset).attention, data)
    cfg.model = cfg.model.replace(attention=attention)  # the typed kind, checked by ModelConfig
    if data_dir:
        cfg.data.data_dir = data_dir
    if seed is not None:  # values, checked by type and range as --set items are (no text to parse)
        set_path(cfg.train, ["seed"], seed, "train.seed", text=False)
    if task_options:
        set_path(cfg.data, ["task_options"], task_options, "data.task_options", text=False)
    cfg = apply_overrides(cfg, list(overrides))
    check_flags_agree(cfg, flags or {}, overrides)
    return cfg


def check_flags_agree(cfg: RunConfig, flags: dict[str, tuple[str, object]], overrides: Sequence[str]) -> None:
    """Refuse a ``--set`` item that sets what an option (``flags``: key -> (option, value)) set, to
    another value: ``--seed 3 --set train.seed=5`` is one line naming both, not seed 5."""
    last = {item.split("=", 1)[0].strip(): item for item in overrides if "=" in item}
    for key, (option, value) in flags.items():
        if key in last and functools.reduce(getattr, key.split("."), cfg) != value:
            raise MheError(f"{option} {value} and --set {last[key]} disagree; give the value once")


def run_config_from_dict(d: object, *, source: str | Path) -> RunConfig:
    """A saved run configuration (``config.json``'s ``run``, ``run.json``), or a one-line error naming ``source``."""
    return run_files.run_config_from_dict(d, source=source, options_of=options_of)


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The configuration a run was started with."""
    return run_config_from_dict(run_files.read_run_record(run_dir)["run"], source=Path(run_dir) / run_files.CONFIG)


def read_run_config_file(path: str | Path) -> RunConfig:
    """A saved configuration on its own (``run.json``, ``mhe run --config``). A run folder's
    ``config.json`` (the record of a run, its configuration under ``run``) is refused naming what
    to pass instead."""
    d = run_files.read_json(path, what="run configuration")
    if isinstance(d, dict) and "run" in d:
        raise MheError(f"{path} is a run folder's config.json (the record of a run), not a run configuration: "
                       "--config takes a run.json (mhe compare writes one beside each run); the configuration of this "
                       "run is the file's 'run' entry: save that alone as a run.json to start it again")
    return run_config_from_dict(d, source=path)
