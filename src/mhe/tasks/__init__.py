"""Training tasks: each implements :class:`mhe.training.task.Task`."""

from mhe.errors import one_of
from mhe.tasks.finetune import FinetuneTask
from mhe.tasks.lm import CausalLMTask
from mhe.tasks.mlm import MaskedLMTask
from mhe.tasks.recall import RecallTask
from mhe.tasks.translation import TranslationTask

TASK_CLASSES = {"lm": CausalLMTask, "mlm": MaskedLMTask, "recall": RecallTask, "mt": TranslationTask,
                "finetune": FinetuneTask}
TASKS = tuple(TASK_CLASSES)


def build_task(name: str, cfg=None):
    """A fresh task object for ``name`` (one of :data:`TASKS`)."""
    if name not in TASK_CLASSES:
        raise one_of("task", name, TASK_CLASSES)
    return TASK_CLASSES[name]()
