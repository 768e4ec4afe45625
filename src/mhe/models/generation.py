"""Beam search for the encoder-decoder, using the KV caches of self- and cross-attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhe.models.decode_step import StepRunner, inference_view, resolve_mode, restorer


def length_penalty(length: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT's ((5 + |Y|) / 6) ** alpha (Wu et al. 2016); alpha = 0 turns it off."""
    return ((5.0 + length.float()) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model, src: torch.Tensor, src_mask: torch.Tensor | None = None, *, bos_id: int, eos_id: int,
                beam: int = 4, max_len: int = 100, alpha: float = 0.6, use_cache: bool = True,
                step_mode: str = "auto", compile_options: dict | None = None, return_scores: bool = False):
    """The best hypothesis per source, ``[B, L]`` starting with ``bos_id``, padded with ``eos_id``.

    Hypotheses are ranked by log-probability; finished ones (ending in EOS) keep their
    score; the final choice divides by the length penalty. ``beam=1`` is greedy search.
    With ``use_cache`` each step is one call of a static decode step (reorder the
    self-attention caches in place by the surviving parents, then decode one token; see
    :mod:`mhe.models.decode_step` for ``step_mode``); fast MHE decodes folded to MQA.
    ``return_scores`` also returns each best hypothesis's length-normalised score ``[B]``.
    """
    b, s = src.shape
    dev = src.device
    view = inference_view(model) if use_cache else model
    memory = view.encode(src, src_mask)
    memory = memory.repeat_interleave(beam, 0)  # [B*k, S, m]
    smask = None if src_mask is None else src_mask.repeat_interleave(beam, 0)
    tokens = torch.full((b * beam, 1), bos_id, dtype=torch.long, device=dev)
    scores = torch.zeros(b, beam, device=dev)
    scores[:, 1:] = float("-inf")  # every beam starts as the same hypothesis: keep one
    finished = torch.zeros(b * beam, dtype=torch.bool, device=dev)
    base = (torch.arange(b, device=dev) * beam)[:, None]
    sel = torch.arange(b * beam, device=dev)
    run = None
    if use_cache:
        caches = view.new_caches(b * beam, max_len, s, dtype=memory.dtype, device=dev)

        def step(tok, parents):
            for self_cache, _ in caches:  # cross-attention caches are equal within a source's beams
                self_cache.reorder(parents)
            return view.decode(tok, memory, smask, caches=caches)[:, -1]  # [B*k, V]

        view.decode(tokens, memory, smask, caches=caches)  # fill the cross-attention caches
        for self_cache, _ in caches:
            self_cache.reset()
        run = StepRunner(step, [tokens, sel], mode=resolve_mode(step_mode, dev), before_warmup=restorer(caches),
                         compile_options=compile_options)
    for t in range(max_len - 1):
        if run is not None:
            logits = run(tokens[:, -1:], sel)
        else:
            logits = model.decode(tokens, memory, smask)[:, -1]
        logp = F.log_softmax(logits.float(), -1)  # [B*k, V]
        vocab = logp.shape[-1]
        logp[finished] = float("-inf")
        logp[finished, eos_id] = 0.0  # a finished hypothesis only repeats EOS, at no cost
        cand = (scores.reshape(-1, 1) + logp).view(b, beam * vocab)
        scores, idx = cand.topk(beam, dim=1)  # [B, k]
        sel = (base + idx // vocab).view(-1)  # surviving parents
        tok = (idx % vocab).view(-1, 1)
        tokens = torch.cat([tokens[sel], tok], 1)
        finished = finished[sel] | (tok.view(-1) == eos_id)
        if t % 4 == 3 and bool(finished.all()):
            break
    is_eos = tokens[:, 1:] == eos_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(is_eos[:, 0], tokens.shape[1] - 1, dtype=torch.long))
    final = scores.view(-1) / length_penalty(first, alpha)
    best_score, best = final.view(b, beam).max(1)
    out = tokens.view(b, beam, -1)[torch.arange(b, device=dev), best]
    # everything after the first EOS becomes EOS
    after = torch.cumsum(out[:, 1:] == eos_id, 1) > 0
    out[:, 1:] = torch.where(after, torch.full_like(out[:, 1:], eos_id), out[:, 1:])
    return (out, best_score) if return_scores else out
