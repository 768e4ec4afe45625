"""Training tasks: each implements :class:`mhe.training.task.Task` and owns its settings (the
class of its ``data.task_options`` and its default run). :data:`TASKS`
(:mod:`mhe.tasks.registry`) is the one registry of task classes; their settings halves, and the
functions that build and read run configurations, are :mod:`mhe.tasks.catalogue`, without torch.

Names are imported on first use (PEP 562), so ``mhe train --help`` and setting errors come
before torch is imported.
"""

import importlib

_WHERE = {"TASKS": "registry", "task_class": "registry", "build_task": "registry",
          "options_of": "catalogue", "default_run": "catalogue", "build_run": "catalogue",
          "check_flags_agree": "catalogue", "run_config_from_dict": "catalogue", "read_run_config": "catalogue",
          "read_run_config_file": "catalogue"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"mhe.tasks.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
