"""A run folder as a Hugging Face ``transformers`` model or as a folder anyone can load.

:func:`from_run` reads a run folder (:func:`mhe.tasks.runs.load_run`) and wraps the model
(:func:`mhe.hf.to_hf`), its tokenizer attached; :func:`export_run` writes the run as a folder
(:func:`mhe.hf.export.save_model`: its own modeling code, or a standard architecture) with the
tokenizer and a model card. Both live here, in ``mhe.tasks``, rather than in ``mhe.hf``: the
adapter sits below the tasks in the import layers (docs/architecture.md) and may not read run
folders, while ``mhe.tasks`` may import both (``mhe.hf`` inside the functions, since it needs
transformers). ``mhe.hf.from_run`` and ``mhe.hf.export_run`` name them lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

from mhe.errors import MheError
from mhe.tasks.runs import load_run
from mhe.training.run_files import locate_run, read_results, read_run_record

TOKEN_IDS = {"bos_token_id": "[BOS]", "eos_token_id": "[EOS]", "pad_token_id": "[PAD]"}
"""Hugging Face config field -> our special token (:data:`mhe.data.tokenize.SPECIALS`)."""


def _root(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    return path.parent.parent if path.parent.name == "checkpoints" else path


def run_tokenizer(run_dir: str | Path):
    """The run's tokenizer as a ``PreTrainedTokenizerFast``, or None when it saved none."""
    from mhe.data.tokenize import load_tokenizer
    from mhe.hf import to_hf_tokenizer

    root = _root(run_dir)
    return to_hf_tokenizer(load_tokenizer(root)) if (root / "tokenizer.json").is_file() else None


def run_token_ids(run_dir: str | Path) -> dict[str, int]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of the run's ``tokenizer.json``
    (those of its special tokens it has; none without a tokenizer). ``run_dir`` may also be one
    of the run's checkpoint folders."""
    file = _root(run_dir) / "tokenizer.json"
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
        The ``MheEncoderFor*``, ``MheDecoderFor*`` or ``MheSeq2SeqLM`` model, in eval mode; with
        the run's tokenizer (``model.tokenizer``) its ``save_pretrained(folder)`` writes the
        tokenizer too, so ``AutoTokenizer`` loads the folder as ``AutoModel*`` does.
    """
    from mhe.hf import to_hf
    from mhe.hf.export import with_tokenizer

    model = load_run(run_dir, data_dir=data_dir, inference=True)[0]
    hf = to_hf(model, **{**_config_ids(model, run_dir), **config_kwargs}).eval()
    tok = run_tokenizer(run_dir)
    return hf if tok is None else with_tokenizer(hf, tok)


def _config_ids(model, run_dir) -> dict[str, int]:
    """The run tokenizer's special-token ids for the config (an encoder-decoder also starts
    decoding from ``[BOS]``, as translation does)."""
    ids = run_token_ids(run_dir)
    if model.cfg.arch == "encoder-decoder" and "bos_token_id" in ids:
        ids["decoder_start_token_id"] = ids["bos_token_id"]
    return ids


def _tokenizer_line(root: Path) -> str:
    """The run's tokenizer in one phrase (:func:`mhe.data.tokenize.describe_tokenizer`; "" without one)."""
    from mhe.data.tokenize import describe_tokenizer, load_tokenizer

    return describe_tokenizer(load_tokenizer(root)) if (root / "tokenizer.json").is_file() else ""


def export_run(run_dir: str | Path, out: str | Path, *, format: str = "remote-code", family: str | None = None,
               data_dir: str = "") -> Path:
    """Write a trained run as a folder transformers loads without mhe (``mhe export``).

    Args:
        run_dir: a run folder (its best evaluated weights, else its newest checkpoint) or one of
            its checkpoint folders.
        out: the new folder.
        format: ``remote-code`` (``config.json`` with ``auto_map``, ``model.safetensors``, the
            standalone modeling code; loads with ``trust_remote_code=True``) or ``standard``
            (Llama/Qwen2/Mistral, GPT-2, BERT or GPTBigCode where one holds the model exactly;
            refused in one line otherwise).
        family: for ``standard`` Llama-style decoders: ``llama``, ``qwen2`` or ``mistral``.
        data_dir: where the run's data is, for tasks that set up from their corpus.

    The folder also holds the run's tokenizer and a model card (``README.md``: architecture,
    attention kind and rotary order, parameters by part, KV-cache bytes per token, the run's
    configuration and scores). Returns ``out``.
    """
    from mhe.hf.export import FORMATS, remote_config, save_model
    from mhe.tasks.model_card import model_card

    if format not in FORMATS:
        raise MheError(f"--format {format!r} is not an export format; valid: {', '.join(FORMATS)}")
    root = locate_run(run_dir)[0]
    model = load_run(run_dir, data_dir=data_dir, inference=True)[0]
    ids = _config_ids(model, run_dir)
    results = read_results(root) if (root / "results.json").is_file() else {}
    card = model_card(model, remote_config(model.cfg), name=root.name, run=read_run_record(root)["run"],
                      results=results, folder_format=format, tokenizer=_tokenizer_line(root))
    return save_model(model, out, format=format, tokenizer=run_tokenizer(run_dir), card=card, family=family, **ids)
