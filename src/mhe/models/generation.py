"""Beam search for the encoder-decoder, using the KV caches of self- and cross-attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhe.models.beam_step import BeamSession, beam_session, source_bucket
from mhe.models.decode_step import resolve_mode


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
    With ``use_cache`` each step is one call of a static beam step (``beam_step.BeamSession``:
    reorder the self-attention caches in place, decode one token, choose the beams; see
    :mod:`mhe.models.decode_step` for ``step_mode``); fast MHE decodes folded to MQA. The
    search stops once every hypothesis has finished, and when at most a quarter of the sources
    still search they go on in a smaller session (``_cached_search``); steps attend over a
    window of the target positions (``beam_step.WINDOW``).
    ``return_scores`` also returns each best hypothesis's length-normalised score ``[B]``.
    """
    b, s = src.shape
    dev = src.device
    if src_mask is None:
        src_mask = torch.ones_like(src, dtype=torch.bool)
    if use_cache:
        tokens, scores = _cached_search(model, src, src_mask, bos_id=bos_id, eos_id=eos_id, beam=beam,
                                        max_len=max_len, mode=resolve_mode(step_mode, dev),
                                        compile_options=compile_options)
    else:
        tokens, scores = _uncached_search(model, src, src_mask, bos_id=bos_id, eos_id=eos_id, beam=beam,
                                          max_len=max_len)
    is_eos = tokens[:, 1:] == eos_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(is_eos[:, 0], tokens.shape[1] - 1, dtype=torch.long))
    final = scores.view(-1) / length_penalty(first, alpha)
    best_score, best = final.view(b, beam).max(1)
    out = tokens.reshape(b, beam, -1)[torch.arange(b, device=dev), best]
    # everything after the first EOS becomes EOS; columns after every row's first EOS are dropped, so the
    # width does not depend on how often the loop checked whether every hypothesis had finished
    after = torch.cumsum(out[:, 1:] == eos_id, 1) > 0
    out = torch.cat([out[:, :1], torch.where(after, torch.full_like(out[:, 1:], eos_id), out[:, 1:])], 1)
    width = int(first.view(b, beam)[torch.arange(b, device=dev), best].max()) + 1
    out = out[:, :width]
    return (out, best_score) if return_scores else out


def _cached_search(model, src, src_mask, *, bos_id, eos_id, beam, max_len, mode, compile_options):
    """Hypotheses ``[B*k, L]`` and scores ``[B, k]`` of the static-step search. When at most a
    quarter of a session's sources are still searching, the rest goes on in a smaller session
    (a power of two of sources; the finished ones are stored), so the longest translation of a
    large batch does not keep every row busy; a source's search is the same in any session."""
    b, s = src.shape
    dev = src.device

    def session_for(n: int) -> BeamSession:
        return beam_session(model, b=n, beam=beam, src_len=source_bucket(s), max_len=max_len, eos_id=eos_id,
                            dtype=next(model.parameters()).dtype, device=dev, mode=mode,
                            compile_options=compile_options)

    session = session_for(b)
    memory = session.view.encode(src, src_mask).repeat_interleave(beam, 0)  # [B*k, S, m]
    session.start(memory, src_mask.repeat_interleave(beam, 0), bos_id)
    tokens = torch.full((b * beam, max_len), eos_id, dtype=torch.long, device=dev)
    scores = torch.zeros(b, beam, device=dev)
    ids = torch.arange(b, device=dev)  # the source of each of the session's sources (-1: a filler)
    t = 0
    while True:
        t = run_steps(session, t, max_len - 1, shrink=mode != "compile")
        active = ~session.finished.view(session.b, beam).all(1)  # [b]
        n = int(active.sum())
        store = ~active if n and t < max_len - 1 else torch.ones_like(active)
        _store(session, store & (ids >= 0), ids, tokens, scores)
        if not n or t >= max_len - 1:
            return tokens[:, :int(session.last) + 1], scores
        keep = active.nonzero().squeeze(1)
        size = 1 << (n - 1).bit_length()  # the next power of two
        fill = size - n
        keep = torch.cat([keep, keep[:1].expand(fill)])
        smaller = session_for(size)
        smaller.take(session, keep)
        ids = torch.cat([ids.index_select(0, keep[:n]), torch.full((fill,), -1, dtype=ids.dtype, device=dev)])
        session = smaller


def _store(session, which: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> None:
    """Copy the hypotheses and scores of the session's sources ``which`` ``[b]`` into the results."""
    k, width = session.beam, int(session.last) + 1
    src = which.nonzero().squeeze(1)
    rows = (src[:, None] * k + torch.arange(k, device=src.device)).view(-1)
    dst = (ids.index_select(0, src)[:, None] * k + torch.arange(k, device=src.device)).view(-1)
    tokens[dst, :width] = session.history.index_select(0, rows)[:, :width]
    scores[ids.index_select(0, src)] = session.scores.index_select(0, src)


def run_steps(session, t: int, steps: int, *, shrink: bool = True) -> int:
    """Run beam steps ``t, t + 1, ...`` (at most up to ``steps``) until every hypothesis has
    finished or, with ``shrink``, at most a quarter of the session's sources (and a power of two
    at most a quarter of them) are still searching; returns the next step's number. On CUDA the
    count read is the one of the step before the newest (copied to pinned memory without
    blocking), so the GPU always has the next step queued: at most one step runs after the
    condition holds, and a finished hypothesis only repeats EOS at no cost, so the answer is the
    one the first possible stop gives."""
    def enough(n: int) -> bool:
        return n == 0 or (shrink and session.b >= 4 and (1 << max(0, n - 1).bit_length()) * 4 <= session.b)

    if session.finished.device.type != "cuda":
        while t < steps:
            session.advance(t)
            t += 1
            if enough(int(session.n_active)):
                break
        return t
    counts = torch.zeros(2, dtype=torch.long).pin_memory()
    events = [torch.cuda.Event(), torch.cuda.Event()]
    first = t
    while t < steps:
        session.advance(t)
        slot = t % 2
        counts[slot].copy_(session.n_active, non_blocking=True)
        events[slot].record()
        t += 1
        if t - 1 > first:
            events[1 - slot].synchronize()  # the step before this one; this one is already queued
            if enough(int(counts[1 - slot])):
                break
    return t


def _uncached_search(model, src, src_mask, *, bos_id, eos_id, beam, max_len):
    """The same search re-reading the whole prefix each step (no cache; for tests)."""
    b, dev = src.shape[0], src.device
    memory = model.encode(src, src_mask).repeat_interleave(beam, 0)  # [B*k, S, m]
    smask = src_mask.repeat_interleave(beam, 0)
    tokens = torch.full((b * beam, 1), bos_id, dtype=torch.long, device=dev)
    scores = torch.zeros(b, beam, device=dev)
    scores[:, 1:] = float("-inf")
    finished = torch.zeros(b * beam, dtype=torch.bool, device=dev)
    base = (torch.arange(b, device=dev) * beam)[:, None]
    for _ in range(max_len - 1):
        logp = F.log_softmax(model.decode(tokens, memory, smask)[:, -1].float(), -1)  # [B*k, V]
        vocab = logp.shape[-1]
        eos_only = torch.full_like(logp[0], float("-inf"))
        eos_only[eos_id] = 0.0
        logp = torch.where(finished[:, None], eos_only, logp)
        scores, idx = (scores.reshape(-1, 1) + logp).view(b, beam * vocab).topk(beam, dim=1)  # [B, k]
        sel = (base + idx // vocab).view(-1)
        tok = (idx % vocab).view(-1, 1)
        tokens = torch.cat([tokens[sel], tok], 1)
        finished = finished[sel] | (tok.view(-1) == eos_id)
        if bool(finished.all()):
            break
    return tokens, scores
