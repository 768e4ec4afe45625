"""Training tasks: each implements :class:`mhe.training.task.Task`."""

from mhe.errors import one_of


def build_task(name: str, cfg=None):
    from mhe.tasks.lm import CausalLMTask
    from mhe.tasks.mlm import MaskedLMTask
    from mhe.tasks.recall import RecallTask
    from mhe.tasks.finetune import FinetuneTask
    from mhe.tasks.translation import TranslationTask

    tasks = {"lm": CausalLMTask, "mlm": MaskedLMTask, "recall": RecallTask, "mt": TranslationTask,
             "finetune": FinetuneTask}
    if name not in tasks:
        raise one_of("task", name, tasks)
    return tasks[name]()


TASKS = ("lm", "mlm", "recall", "mt", "finetune")
