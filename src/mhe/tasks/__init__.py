"""Training tasks: each implements :class:`mhe.training.task.Task` and owns its settings (the
class of its ``data.task_options`` and its default run). :data:`TASKS`
(:mod:`mhe.tasks.registry`) is the one registry: the command line's help and errors are built
from it and from its torch-free list of names and summaries (:mod:`mhe.tasks.catalogue`).

Names are imported on first use (PEP 562), so ``mhe train --help`` starts without torch.
"""

import importlib

_REGISTRY = ("TASKS", "task_class", "build_task", "options_of", "default_run", "build_run", "run_config_from_dict",
             "read_run_config", "read_run_config_file")

__all__ = list(_REGISTRY)


def __getattr__(name: str):
    if name in _REGISTRY:
        return getattr(importlib.import_module("mhe.tasks.registry"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
