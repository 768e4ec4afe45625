"""From a trained multi-head model to another attention kind (``mhe convert``).

* :func:`convert_model` (``mhe.convert.model``): the model-level API, every attention sublayer
  fitted (:mod:`mhe.convert.targets` says what each fit minimises), everything else copied;
* :func:`convert_run` (``mhe.convert.runs``): a run folder or a Hugging Face directory in, a
  run folder out that ``mhe eval``, ``generate``, ``finetune`` and ``pretrain --init-from`` take,
  with the score of the source and of the converted model before any training.
"""

from mhe.convert.model import SOURCES, convert_model
from mhe.convert.stats import attention_modules, input_stats
from mhe.convert.report import ConversionReport
from mhe.convert.targets import TARGETS

__all__ = ["SOURCES", "TARGETS", "ConversionReport", "attention_modules", "convert_model", "input_stats"]
