"""A run folder as a Hugging Face ``transformers`` model, in one call.

:func:`from_run` reads a run folder (:func:`mhe.tasks.runs.load_run`) and wraps the model
(:func:`mhe.hf.to_hf`). It lives here, in ``mhe.tasks``, rather than in ``mhe.hf``: the adapter
sits below the tasks in the import layers (docs/architecture.md) and may not read run folders,
while ``mhe.tasks`` may import both (``mhe.hf`` inside the function, since it needs transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

from mhe.tasks.runs import load_run

TOKEN_IDS = {"bos_token_id": "[BOS]", "eos_token_id": "[EOS]", "pad_token_id": "[PAD]"}
"""Hugging Face config field -> our special token (:data:`mhe.data.tokenize.SPECIALS`)."""


def run_token_ids(run_dir: str | Path) -> dict[str, int]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of the run's ``tokenizer.json``
    (those of its special tokens it has; none without a tokenizer). ``run_dir`` may also be one
    of the run's checkpoint folders."""
    path = Path(run_dir)
    root = path.parent.parent if path.parent.name == "checkpoints" else path
    file = root / "tokenizer.json"
    if not file.is_file():
        return {}
    added = {t["content"]: t["id"] for t in json.loads(file.read_text()).get("added_tokens", [])}
    return {field: added[token] for field, token in TOKEN_IDS.items() if token in added}


def from_run(run_dir: str | Path, *, data_dir: str = "", **config_kwargs):
    """The Hugging Face model of a trained run: ``to_hf(load_run(run_dir)[0])`` with the run
    tokenizer's ``[BOS]``/``[EOS]``/``[PAD]`` ids in its config (an encoder-decoder also starts
    decoding from ``[BOS]``, as translation does). Keeps the weights bit for bit: ``load_run``
    loads them exactly and ``to_hf`` wraps the module without re-initialising it.

    Args:
        run_dir: a run folder (its best evaluated weights, else its newest checkpoint) or one
            of its checkpoint folders.
        data_dir: where the run's data is, for tasks that set up from their corpus (see
            :func:`~mhe.tasks.runs.load_run`).
        **config_kwargs: configuration fields (e.g. ``eos_token_id``); they win over the
            tokenizer's ids.

    Returns:
        The ``MheEncoderFor*``, ``MheDecoderFor*`` or ``MheSeq2SeqLM`` model, in eval mode.
    """
    from mhe.hf import to_hf

    model = load_run(run_dir, data_dir=data_dir, inference=True)[0]
    ids = run_token_ids(run_dir)
    if model.cfg.arch == "encoder-decoder" and "bos_token_id" in ids:
        ids["decoder_start_token_id"] = ids["bos_token_id"]
    return to_hf(model, **{**ids, **config_kwargs}).eval()
