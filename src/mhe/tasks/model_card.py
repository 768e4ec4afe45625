"""The model card (``README.md``) of an exported run: what the model is, what it holds, how to
load it, and how it was trained and scored.

Every number is read from the model and the run folder: parameters counted by part from the
model's own tensors (tied weights once), the KV cache from the exported configuration's cached
heads (one for MQA and fast MHE, g for GQA, n for MHA), the configuration from the run's
``config.json`` and the scores from its ``results.json``.
"""

from __future__ import annotations

import json

from mhe.models import ModelConfig

AUTO = {"decoder": "AutoModelForCausalLM", "encoder": "AutoModelForMaskedLM",
        "encoder-decoder": "AutoModelForSeq2SeqLM"}
PARTS = ("embeddings", "attention", "feed-forward", "norms", "head")


def architecture(cfg: ModelConfig) -> str:
    """One line: the family and what sets it apart."""
    if cfg.arch == "encoder-decoder":
        return "Transformer encoder-decoder (sinusoidal positions, shared embeddings)"
    if cfg.arch == "encoder":
        return "BERT-like encoder (learned positions, post-LN LayerNorm)"
    if cfg.positions == "rotary":
        return "Llama-style decoder (rotary positions, RMSNorm, SwiGLU)"
    return f"GPT-2-style decoder ({cfg.positions} positions, pre-LN {cfg.norm}, {cfg.mlp} feed-forward)"


def attention_line(cfg: ModelConfig) -> str:
    """The kind and, for MHE, its psi and (under rotary positions) the order of psi and RoPE."""
    spec = cfg.spec
    line = spec.name
    if spec.is_mhe:
        psi = {"mul": "A * (1 + e_i)", "add": "A + e_i"}[spec.psi]
        line += f" (multi-head embedding attention, psi = {psi}"
        if cfg.positions == "rotary":
            line += f"; rotary order {cfg.attn_options.rope_order}"
        line += ")"
    elif spec.grouped:
        line += f" ({cfg.attn_options.n_kv_heads or 'default'} K/V heads)"
    return line


def parameters_by_part(model) -> dict[str, int]:
    """Parameters of ``model`` by part (tied tensors once) and their ``total``."""
    counts = dict.fromkeys(PARTS, 0)
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        parts = name.split(".")
        if "self_attn" in parts or "cross_attn" in parts:
            part = "attention"
        elif "ffn" in parts:
            part = "feed-forward"
        elif any(x.endswith("norm") for x in parts[:-1]):
            part = "norms"
        elif "embed" in parts:
            part = "embeddings"
        else:
            part = "head"
        counts[part] += p.numel()
    return {**counts, "total": sum(counts.values())}


def kv_cache_line(config) -> str:
    """Self-attention K/V cache per generated token, in bf16/fp16, from the exported config."""
    s = config.mhe
    if s["arch"] == "encoder":
        return "none (an encoder)"
    heads, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    if heads == 0:
        return "none (the kind mixes whole sequences; generation recomputes them)"
    return (f"{2 * layers * heads * d * 2:,} bytes per token in bf16/fp16 "
            f"(keys and values: {layers} {_plural(layers, 'layer')} x {heads} K/V {_plural(heads, 'head')} x {d})")


def _plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"


def _scores(results: dict) -> list[tuple[str, str]]:
    rows = []
    for key, value in sorted(results.items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        rows.append((_with_unit(key, results), f"{value:.6g}" if isinstance(value, float) else str(value)))
    return rows


def _with_unit(key: str, results: dict) -> str:
    """``key`` with the unit of its perplexity: ``word_perplexity`` is per word, every other
    perplexity per the run's ``perplexity_per`` (``word`` for a word-level tokenizer, else ``token``)."""
    if "perplexity" not in key or key == "perplexity_per":
        return key
    per = "word" if "word_perplexity" in key else results.get("perplexity_per")
    return f"{key} (per {per})" if per else key


def _tokenizer_lines(tokenizer: str, results: dict) -> list[str]:
    """The card's tokenizer section: what the scores were measured with; an ids-only tokenizer said plainly."""
    lines = ["## Tokenizer", ""]
    if not tokenizer:
        return lines + ["The run saved no tokenizer: the model takes token ids.", ""]
    lines.append(f"`tokenizer.json`: {tokenizer}.")
    if any("perplexity" in k for k in results):
        measured = results.get("tokenizer", tokenizer)
        lines.append(f"The perplexities below were measured with the run's tokenizer ({measured}): "
                     "per word for a word-level tokenizer, else per token (`word_perplexity`: per word).")
    if tokenizer.startswith("ids only"):
        lines.append("**This tokenizer holds ids only**: the model was converted from a checkpoint saved without a "
                     "tokenizer, and the tokenizer here names the model's ids (`[unused-N]`, with its BOS/EOS/PAD) but "
                     "encodes no text. Feed token ids (`model(input_ids)`), or use the source model's own tokenizer "
                     "with these weights; text given to this tokenizer becomes unknown ids.")
    return lines + [""]


def model_card(model, config, *, name: str, run: dict, results: dict, folder_format: str,
               tokenizer: str = "") -> str:
    """The card's Markdown (``config``: the exported remote configuration, for the cache;
    ``tokenizer``: the run's tokenizer in one phrase, :func:`mhe.data.tokenize.describe_tokenizer`)."""
    cfg = model.cfg
    auto = AUTO[cfg.arch] if cfg.head in ("lm", "mlm", "seq2seq") else \
        "AutoModelForQuestionAnswering" if cfg.head == "qa" else "AutoModelForSequenceClassification"
    trust = ", trust_remote_code=True" if folder_format == "remote-code" else ""
    rows = [("architecture", architecture(cfg)), ("attention", attention_line(cfg)),
            ("layers x width", f"{cfg.n_layers} x {cfg.d_model}"),
            ("heads x head size", f"{cfg.n_heads} x {cfg.resolved_head_dim}"),
            ("feed-forward width", str(cfg.d_ff)), ("vocabulary", f"{cfg.vocab_size:,}"),
            ("tokenizer", tokenizer or "none saved"), ("positions", str(cfg.max_len)),
            ("KV cache", kv_cache_line(config))]
    lines = ["---", "library_name: transformers", "tags:", "- mhe", "- multi-head-embedding-attention", "---", "",
             f"# {name}", "",
             f"A {architecture(cfg)} with {cfg.attention} attention, trained with mhe (multi-head embedding "
             "attention; Xue & Aletras, \"Pit One Against Many\", Findings of EMNLP 2023).", "",
             "| | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows], "",
             "## Parameters", "", "| part | parameters |", "| --- | ---: |",
             *[f"| {k} | {v:,} |" for k, v in parameters_by_part(model).items()], "",
             "## Loading", "", "Run from this folder (or set `folder` to its path):", "",
             "```python", f"from transformers import AutoTokenizer, {auto}", "", 'folder = "."',
             f"tokenizer = AutoTokenizer.from_pretrained(folder{trust})",
             f"model = {auto}.from_pretrained(folder{trust})", "```", ""]
    if folder_format == "remote-code":
        lines += ["The modeling code (`modeling_mhe.py`, `layers_mhe.py`, `decode_mhe.py`, `configuration_mhe.py`) is in this folder and needs only "
                  "torch and transformers. LoRA (peft) targets: `q_proj`, `k_proj`, `v_proj`, `out_proj` "
                  "(attention) and `fc_in`, `fc_out` or `gate`, `up`, `down` (feed-forward).", ""]
    lines += _tokenizer_lines(tokenizer, results)
    scores = _scores(results)
    if scores:
        lines += ["## Scores", "", "| metric | value |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in scores], ""]
    lines += ["## Training run", "", "```json", json.dumps(run, indent=2, sort_keys=True), "```", ""]
    return "\n".join(lines)
