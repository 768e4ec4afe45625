"""Whether a run can see text (issue 58), checked from its folder alone and without torch, so
that a command given text refuses an ids-only run at once.

``mhe convert`` of a Hugging Face folder without a tokenizer writes a run whose tokenizer holds
ids only (:func:`mhe.data.tokenize.ids_only`): every line of text would become one ``[PAD]``.
Such a run can be converted again and its ids used directly; a command that encodes text
(``pretrain --init-from``, ``eval``, ``generate``, ``finetune``, a comparison started from it)
refuses it in one line naming the conversion to redo (:func:`refuse_ids_only_run`).
"""

from __future__ import annotations

from pathlib import Path

from mhe.data.tokenize import ids_only, load_tokenizer, refuse_ids_only
from mhe.training.run_files import locate_run, read_run_record


def run_source(run_dir: Path) -> str:
    """The checkpoint a converted run came from (``config.json``'s ``converted_from``), else ""."""
    origin = read_run_record(run_dir).get("converted_from")
    return str(origin.get("path", "")) if isinstance(origin, dict) else ""


def holds_ids_only(path: str | Path, option: str = "--run") -> bool:
    """Whether the run at ``path`` (a run folder or one of its checkpoints) has a tokenizer of ids only."""
    run_dir = locate_run(path, option)[0]
    return (run_dir / "tokenizer.json").is_file() and ids_only(load_tokenizer(run_dir))


def refuse_ids_only_run(path: str | Path, option: str = "--run", *, doing: str = "encode text") -> None:
    """A one-line :class:`~mhe.errors.MheError` when the run at ``path`` (named by ``option``)
    holds a tokenizer of ids only; ``doing``: what the command would do with it."""
    run_dir = locate_run(path, option)[0]
    if (run_dir / "tokenizer.json").is_file():
        refuse_ids_only(load_tokenizer(run_dir), f"{option} {path}: its tokenizer", source=run_source(run_dir),
                        doing=doing)
