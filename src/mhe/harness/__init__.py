"""An mhe run scored by EleutherAI's lm-evaluation-harness (``mhe eval --harness TASKS``).

:mod:`mhe.harness.evaluate` exports the run to a temporary folder (its own modeling code, as
``mhe export`` writes it), hands that folder to the harness's ``hf`` model with
``trust_remote_code=True`` and keeps the harness's results table in the run folder. The folder
``tasks`` holds offline task definitions (YAML over the project's data files, read by
``tasks/mhe_loaders.py``; no download): ``mhe_wikitext2`` and ``mhe_ptb`` (rolling perplexity)
and ``mhe_rte``, ``mhe_cb``, ``mhe_copa``, ``mhe_wic`` (zero-shot multiple choice), all under
the tag ``mhe_offline``. lm-eval is an optional extra (``pip install mhe[eval]``), imported
only when an evaluation runs.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).with_name("tasks")
"""The offline task definitions: pass it to the harness as ``--include_path``."""
