"""The task registry: :data:`TASKS` maps each task's name to its class (each implements
:class:`mhe.training.task.Task` and owns its settings: the class of its ``data.task_options`` and
its default run), and the functions that build runs and read saved configurations from it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mhe.errors import MheError, one_of
from mhe.models.config import preset as get_preset
from mhe.tasks.catalogue import CATALOGUE
from mhe.tasks.finetune import FinetuneTask
from mhe.tasks.lm import CausalLMTask
from mhe.tasks.mlm import MaskedLMTask
from mhe.tasks.recall import RecallTask
from mhe.tasks.translation import TranslationTask
from mhe.training import run_files
from mhe.training.config import RunConfig, apply_overrides
from mhe.training.task import Task

TASKS: dict[str, type[Task]] = {"lm": CausalLMTask, "mlm": MaskedLMTask, "recall": RecallTask,
                                "mt": TranslationTask, "finetune": FinetuneTask}

if list(TASKS) != list(CATALOGUE) or any((c.command, c.summary) != CATALOGUE[n] for n, c in TASKS.items()):
    raise MheError("mhe.tasks.catalogue and the task classes disagree; keep them one table")


def task_class(name: str) -> type[Task]:
    """The class of task ``name`` (one of :data:`TASKS`)."""
    if name not in TASKS:
        raise one_of("task", name, TASKS)
    return TASKS[name]


def build_task(name: str) -> Task:
    """A fresh task object for ``name``."""
    return task_class(name)()


def options_of(name: str) -> type:
    """The class of task ``name``'s ``data.task_options``."""
    return task_class(name).options


def default_run(task: str, preset: str, attention: str = "mha", dataset: str = "") -> RunConfig:
    """The task's default run for a model preset, attention kind and data set (``Task.default_config``)."""
    return task_class(task).default_config(preset, attention=attention, dataset=dataset)


def build_run(task: str, preset: str, *, attention: str = "mha", data: str = "", data_dir: str = "",
              seed: int | None = None, overrides: Sequence[str] = (), task_options: dict | None = None) -> RunConfig:
    """A run's typed configuration as the training commands build it: the task's defaults, then
    the attention kind, the data folder, the seed, the task options and every ``--set`` item
    (in that order, so a ``--set`` item wins), all checked before anything is read or written.
    The run starts from the preset's own kind, so a kind of the same family keeps the preset's
    options (``--preset llama-135m --attention gqa``: its 3 K/V heads)."""
    cfg = default_run(task, preset, get_preset(preset).attention, data)
    items = [f"model.attention={attention}"]
    if data_dir:
        cfg.data.data_dir = data_dir
    if seed is not None:
        items.append(f"train.seed={seed}")
    if task_options:
        items.append(f"data.task_options={json.dumps(task_options)}")
    return apply_overrides(cfg, items + list(overrides))


def run_config_from_dict(d: object, *, source: str | Path) -> RunConfig:
    """A saved run configuration (``config.json``'s ``run``, ``run.json``), or a one-line error naming ``source``."""
    return run_files.run_config_from_dict(d, source=source, options_of=options_of)


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The configuration a run was started with."""
    return run_config_from_dict(run_files.read_run_record(run_dir)["run"], source=Path(run_dir) / run_files.CONFIG)


def read_run_config_file(path: str | Path) -> RunConfig:
    """A saved configuration on its own (``run.json``, ``mhe run --config``)."""
    return run_config_from_dict(run_files.read_json(path, what="run configuration"), source=path)
