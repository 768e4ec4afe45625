"""The task registry: :data:`TASKS` maps each task's name to its class (each implements
:class:`mhe.training.task.Task` on top of its settings half, :mod:`mhe.tasks.catalogue`: setup,
batches, loss, evaluation)."""

from __future__ import annotations

from mhe.errors import MheError, one_of
from mhe.tasks.catalogue import CATALOGUE
from mhe.tasks.finetune import FinetuneTask
from mhe.tasks.lm import CausalLMTask
from mhe.tasks.mlm import MaskedLMTask
from mhe.tasks.recall import RecallTask
from mhe.tasks.translation import TranslationTask
from mhe.training.task import Task

TASKS: dict[str, type[Task]] = {"lm": CausalLMTask, "mlm": MaskedLMTask, "recall": RecallTask,
                                "mt": TranslationTask, "finetune": FinetuneTask}

if list(TASKS) != list(CATALOGUE) or any(not issubclass(cls, CATALOGUE[n]) for n, cls in TASKS.items()):
    raise MheError("mhe.tasks.registry.TASKS and mhe.tasks.catalogue.CATALOGUE disagree; keep them one table")


def task_class(name: str) -> type[Task]:
    """The class of task ``name`` (one of :data:`TASKS`)."""
    if name not in TASKS:
        raise one_of("task", name, TASKS)
    return TASKS[name]


def build_task(name: str) -> Task:
    """A fresh task object for ``name``."""
    return task_class(name)()
