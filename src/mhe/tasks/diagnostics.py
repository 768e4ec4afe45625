"""SuperGLUE's diagnostics scored as SuperGLUE does: with a model fine-tuned on RTE
(Wang et al. 2019, section 3.3 and Appendix C).

* AX-b (broad-coverage): Matthews correlation (R3) of the RTE model's entailment labels;
* AX-g (Winogender, Rudinger et al. 2018): accuracy and gender parity, the share of minimal
  pairs (same hypothesis, the pronoun's gender swapped) given the same label.

``mhe diagnostics --run RTE_RUN`` prints both and, with ``--out DIR``, writes the
predictions as SuperGLUE submission files (``AX-b.jsonl``, ``AX-g.jsonl``: ``idx`` and ``label``).
"""

from __future__ import annotations

import json
from pathlib import Path

from mhe.data.benchmarks import read_examples
from mhe.errors import MheError, one_of
from mhe.metrics.classification import task_metrics
from mhe.tasks import read_run_config
from mhe.tasks.runs import load_run
from mhe.training.checkpoint import write_text_atomic
from mhe.training.run_files import require_run_dir

DIAGNOSTICS = ("ax-b", "ax-g")
RTE_TASKS = ("rte", "sg-rte")
SUBMISSION = {"ax-b": "AX-b.jsonl", "ax-g": "AX-g.jsonl"}


def evaluate_diagnostics(checkpoint, *, tasks=DIAGNOSTICS, data_dir: str = "", out: str = "") -> dict:
    """Scores of each diagnostic in ``tasks`` for the RTE fine-tuning run ``checkpoint``.

    Returns:
        ``{task: {"metric": ..., "score": ..., <every metric>, "total": n}}``.
    """
    for t in tasks:
        if t not in DIAGNOSTICS:
            raise one_of("diagnostic", t, DIAGNOSTICS)
    cfg = read_run_config(require_run_dir(checkpoint))  # the run's type first: nothing else is read
    if cfg.task != "finetune" or cfg.data.task_options.task not in RTE_TASKS:
        raise MheError(f"{checkpoint} is not a run fine-tuned on RTE (rte or sg-rte); the diagnostics use one")
    model, cfg, task = load_run(checkpoint, data_dir=data_dir)
    results = {}
    for name in tasks:
        examples = read_examples(name, "test", data_dir=cfg.data.data_dir or None)
        pred = task.predict(model, examples)
        extra = {"pair_ids": [e.group for e in examples]} if name == "ax-g" else {}
        res = task_metrics(name, pred, [e.label for e in examples], **extra)
        results[name] = {**res, "total": len(examples)}
        if out:
            _write_submission(Path(out) / SUBMISSION[name], examples, pred, task.spec.labels)
    return results


def _write_submission(path: Path, examples, pred, labels) -> None:
    lines = [json.dumps({"idx": int(e.uid) if e.uid.isdigit() else e.uid, "label": labels[p]})
             for e, p in zip(examples, pred)]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "\n".join(lines) + "\n")
