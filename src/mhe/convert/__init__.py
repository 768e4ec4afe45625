"""From a trained multi-head model to another attention kind (``mhe convert``).

* :func:`convert_model` (``mhe.convert.model``): the model-level API, every attention sublayer
  fitted (:mod:`mhe.convert.targets` says what each fit minimises), everything else copied;
* :func:`convert_run` (``mhe.convert.runs``): a run folder or a Hugging Face directory in, a
  run folder out that ``mhe eval``, ``generate``, ``finetune`` and ``pretrain --init-from`` take,
  with the score of the source and of the converted model before any training;
* :mod:`mhe.convert.outputs`: the output fit (``mhe convert --fit outputs``), each sublayer then
  fitted to the source sublayer's outputs on calibration sequences;
* :func:`mhe.convert.fold.fold_rope_order`: an MHE-Mul ``psi-then-rope`` model as ``rope-then-psi``
  (one K/V head), exact only when its factors allow it.

Names are imported on first use (PEP 562): ``mhe convert --help`` reads the targets without torch.
"""

import importlib

_WHERE = {"SOURCES": "model", "convert_model": "model", "attention_modules": "stats", "input_stats": "stats",
          "ConversionReport": "report", "TARGETS": "options"}

__all__ = ["SOURCES", "TARGETS", "ConversionReport", "attention_modules", "convert_model", "input_stats"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
