"""transformers' ``generate`` of the causal-LM adapter on our captured decode step.

:func:`fast_generate` answers what ``MheDecoderForCausalLM.generate`` is asked when the request
is one our :func:`mhe.generation.session.generate` computes exactly as transformers' sampling
loop does, and runs it there: the core model's session (its default session, reused across
calls: the caches hold each kind's K/V heads, one for MHE, and the step is one replayed CUDA
graph per token). Supported: greedy search and sampling with temperature, top-k and top-p
(seeded by ``torch.manual_seed``, as transformers' draws are); no cache implementation given,
or ``"static"``; an ``attention_mask`` of left padding; the end tokens and pad token of the
generation config; ``max_new_tokens``/``max_length`` and ``min_new_tokens``/``min_length``;
``return_dict_in_generate`` with ``output_logits`` (the returned output carries no cache: the
session keeps it). Anything else (beam search, other logits processors or stopping criteria,
streamers, assisted decoding, other caches, an explicit cache, ``inputs_embeds``) returns None
and transformers' own ``generate`` runs, through the adapter's cache mapping
(:class:`~mhe.hf.modeling.LayerCache`).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from mhe.errors import MheError
from mhe.generation.sampling import SamplingConfig

SUPPORTED = {"max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k",
             "top_p", "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id",
             "cache_implementation", "use_cache", "return_dict_in_generate", "output_logits", "compile_config",
             "disable_compile", "transformers_version", "_from_model_config", "_commit_hash",
             "_original_object_hash"}
"""Generation-config fields the fast path reads or that change nothing it computes; any other
field away from its default sends the request to transformers' loop."""

HF_ONLY_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                     "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                     "custom_generate", "assistant_tokenizer", "tokenizer", "use_model_defaults")
"""``generate`` arguments only transformers' loop serves (when given)."""


def _defaults() -> dict:
    base = GenerationConfig()
    if hasattr(GenerationConfig, "_get_default_generation_params"):  # transformers >= 5.x: fields default to None
        base.update(**GenerationConfig._get_default_generation_params())
    return base.to_dict()


def _plain(cfg: GenerationConfig) -> bool:
    """Only :data:`SUPPORTED` fields differ from the defaults (None and False count as unset),
    with one sequence per prompt, no beams and a cache we can stand for."""
    given, base = cfg.to_dict(), _defaults()
    for key in set(given) | set(base):
        a, b = given.get(key), base.get(key)
        if key not in SUPPORTED and a != b and not (a in (None, False) and b in (None, False)):
            return False
    return cfg.cache_implementation in (None, "static") and cfg.use_cache is not False


def _mask(ids: torch.Tensor, mask, pad: int | None):
    """The prompts' mask if it is left padding (None: no padding), False when transformers must
    decide (a mask with gaps or right padding; no mask but pad tokens in the prompts, from which
    transformers infers one). Reads the device once."""
    if mask is None:
        return False if pad is not None and bool((ids == pad).any()) else None
    mask = mask.to(torch.bool)
    if mask.shape != ids.shape or not bool(mask[:, -1].all() & (mask[:, 1:] >= mask[:, :-1]).all()):
        return False
    return mask


def _request(wrapper, ids, generation_config, kwargs: dict):
    """(config, attention mask) of a request the fast path serves, else None."""
    try:
        cfg, model_kwargs = wrapper._prepare_generation_config(generation_config, **kwargs)
    except Exception:  # noqa: BLE001  transformers raises its own error in its own loop
        return None
    mask = model_kwargs.pop("attention_mask", None)
    if any(v is not None for v in model_kwargs.values()) or not _plain(cfg):
        return None
    return cfg, mask


def fast_generate(wrapper, inputs, generation_config, kwargs: dict):
    """What ``wrapper.generate(inputs, generation_config, **kwargs)`` returns, computed by the
    core model's ``generate``; None when the request needs transformers' own loop."""
    if not getattr(wrapper, "use_mhe_generate", False) or any(kwargs.get(k) not in (None, [], ())
                                                               for k in HF_ONLY_ARGUMENTS):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k not in HF_ONLY_ARGUMENTS}
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        return None
    request = _request(wrapper, ids, generation_config, kwargs)
    if request is None:
        return None
    cfg, mask = request
    p = ids.shape[1]
    new = cfg.max_new_tokens if cfg.max_new_tokens is not None else (cfg.max_length or 0) - p
    eos = [] if cfg.eos_token_id is None else ([cfg.eos_token_id] if isinstance(cfg.eos_token_id, int)
                                               else list(cfg.eos_token_id))
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else None)
    mask = _mask(ids, mask, pad)
    if new < 1 or mask is False:
        return None
    try:
        sampling = SamplingConfig(do_sample=True, temperature=cfg.temperature or 1.0, top_k=cfg.top_k or 0,
                                  top_p=cfg.top_p if cfg.top_p is not None else 1.0) if cfg.do_sample else None
    except MheError:  # a setting transformers judges itself
        return None
    least = max(cfg.min_new_tokens or 0, (cfg.min_length or 0) - p, 0)
    wrapper._sync_kernel()
    options = {} if sampling is None else dict(do_sample=True, temperature=sampling.temperature,
                                               top_k=sampling.top_k, top_p=sampling.top_p)
    out = wrapper.mhe.generate(ids, new, attention_mask=mask, stop_ids=eos, pad_id=pad, min_new_tokens=least,
                               return_logits=bool(cfg.output_logits), return_dict=True, **options)
    if not cfg.return_dict_in_generate:
        return out.tokens
    from transformers.generation import GenerateDecoderOnlyOutput

    logits = tuple(out.logits.float().unbind(1)) if cfg.output_logits else None
    return GenerateDecoderOnlyOutput(sequences=out.tokens, logits=logits)
