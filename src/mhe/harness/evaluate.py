"""Run lm-evaluation-harness on an mhe run and keep its results table in the run folder.

The run is exported with :func:`mhe.tasks.hf_runs.export_run` (remote code: every attention
kind loads) into a temporary folder, which the harness's ``hf`` model loads as any Hugging Face
model; nothing of mhe runs inside the harness but the offline task loaders. The harness's
rolling windows start each document from ``prefix_token_id``: this module passes the run's
``[EOS]`` (the token every line follows in mhe's training streams) instead of the harness's
default ``[BOS]``, which an mhe language model never saw.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

from mhe.errors import MheError
from mhe.harness import TASKS_DIR
from mhe.progress import note
from mhe.tasks.hf_runs import export_run, run_token_ids
from mhe.training.atomic import write_text_atomic
from mhe.training.run_files import locate_run

LM_EVAL_VERSION = "0.4.13"
"""The lm-eval release this module and its tasks were tested with (the ``eval`` extra pins it)."""
OFFLINE_TASKS = ("mhe_offline", "mhe_wikitext2", "mhe_ptb", "mhe_rte", "mhe_cb", "mhe_copa", "mhe_wic")
"""The tag of the shipped tasks, then each of them (``tasks/*.yaml``)."""
RESULTS_JSON = "harness-results.json"
RESULTS_MD = "harness-results.md"


def require_lm_eval() -> None:
    """One line naming the extra to install when the harness is missing."""
    if importlib.util.find_spec("lm_eval") is None:
        raise MheError("--harness needs the optional lm-evaluation-harness package: pip install 'mhe[eval]' "
                       f"(lm-eval=={LM_EVAL_VERSION})")


def task_list(spec: str) -> list[str]:
    """``TASKS`` of ``--harness TASKS``: comma-separated task, group or tag names."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise MheError(f"--harness needs task names (comma-separated, e.g. mhe_offline or mhe_wikitext2,mhe_rte), "
                       f"got {spec!r}")
    return names


def model_args(folder: str | Path, *, prefix_token_id: int | None, max_length: int | None) -> dict:
    """The harness's ``hf`` model arguments for an exported folder (float32 weights)."""
    args = {"pretrained": str(folder), "trust_remote_code": True, "dtype": "float32"}
    if prefix_token_id is not None:
        args["prefix_token_id"] = prefix_token_id
    if max_length is not None:
        args["max_length"] = max_length
    return args


def run_harness(run: str | Path, tasks: list[str], *, data_dir: str = "", limit: float | None = None,
                device: str = "cpu", batch_size: int = 16, max_length: int | None = None) -> dict:
    """The harness's results for ``run`` on ``tasks`` (``simple_evaluate``'s dictionary, with its
    per-document ``samples``). ``limit``: documents per task (a fraction below 1); ``max_length``:
    the harness's window (default the model's); ``data_dir``: the data folder the offline tasks read."""
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    metadata = {"data_dir": str(Path(data_dir).resolve())} if data_dir else {}
    manager = TaskManager(include_path=str(TASKS_DIR), metadata=metadata)
    unknown = [name for name in tasks if name not in manager.all_tasks]
    if unknown:
        raise MheError(f"--harness: no task {unknown[0]!r}; the offline ones are {', '.join(OFFLINE_TASKS)} "
                       "(or name any task lm-eval knows)")
    with tempfile.TemporaryDirectory(prefix="mhe-harness-") as tmp:
        note(f"exporting {run} for the harness", enabled=True)
        folder = export_run(run, Path(tmp) / "model", data_dir=data_dir)
        classes = [c for c in json.loads((folder / "config.json").read_text()).get("auto_map", {})
                   if c.startswith("AutoModel")]
        if "AutoModelForCausalLM" not in classes:
            raise MheError(f"--harness scores language models (decoder runs); {run} exports as "
                           f"{', '.join(classes) or 'no model class'}")
        prefix = run_token_ids(run).get("eos_token_id")
        return simple_evaluate(model="hf", model_args=model_args(folder, prefix_token_id=prefix,
                                                                 max_length=max_length),
                               tasks=tasks, task_manager=manager, limit=limit, device=device,
                               batch_size=batch_size, log_samples=True, metadata=metadata)


def results_table(results: dict) -> str:
    """The harness's own markdown table of ``results`` (and of its groups, when any)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def document_scores(results: dict) -> dict:
    """Per task, each document's id and the harness's log-likelihoods for it (one for a rolling
    perplexity task, one per choice for multiple choice), in document order."""
    out = {}
    for task, samples in results.get("samples", {}).items():
        rows = [{"doc_id": s["doc_id"], "loglikelihoods": [float(r[0]) if isinstance(r, (list, tuple)) else float(r)
                                                           for r in s["filtered_resps"]]} for s in samples]
        out[task] = sorted(rows, key=lambda r: r["doc_id"])
    return out


def save_results(results: dict, run: str | Path) -> tuple[Path, Path]:
    """Write the results (without the documents' texts) as JSON and the table as markdown in the
    run folder, each atomically; returns both paths."""
    from lm_eval.utils import handle_non_serializable

    root = locate_run(run)[0]
    kept = {key: results[key] for key in ("results", "groups", "group_subtasks", "configs", "versions", "n-shot",
                                          "higher_is_better", "n-samples", "config") if key in results}
    kept["documents"] = document_scores(results)
    kept["lm_eval_version"] = _lm_eval_version()
    json_path, md_path = root / RESULTS_JSON, root / RESULTS_MD
    write_text_atomic(json_path, json.dumps(kept, indent=2, default=handle_non_serializable) + "\n")
    write_text_atomic(md_path, results_table(results))
    return json_path, md_path


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
