"""Beam search for the encoder-decoder, one static step per token: the beam policy of a decode session.

One step reorders the self-attention caches in place by the surviving parents, decodes the
last token of every hypothesis, and does the beam bookkeeping (log-softmax, finished
hypotheses only extend with EOS at no cost, top-k over beam x vocabulary, the token history)
on tensors, so :class:`~mhe.generation.step.StepRunner` can replay it as a CUDA graph or
compile it once. What outlives one batch belongs to a :class:`BeamSearcher` the caller holds
(a :class:`~mhe.generation.session.DecodeSession` of the ``beam`` policy): the inference view of
the model (fast MHE folded to MQA), its decode plan (:func:`~mhe.attention.kernels.decode_plan`'s
kernel over dense masks, passed to every ``view.decode``: the decoder's self- and cross-attention
run it, the encoder its configured kernel), the captured steps, and one :class:`BeamSession` (buffers) per shape (rows, beam, source length rounded up to a multiple of
:data:`SOURCE_BUCKET`), reused by later batches: capturing costs far more than a step. A step
attends over (and reorders) only the first :data:`WINDOW`-multiple of target positions that
holds its token (one captured step per window), as its mask says (``keys``). The search stops
once every hypothesis has finished (:func:`run_steps`); when at most a quarter of a batch's
sources still search, they go on in a smaller session.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhe.attention import masks
from mhe.attention.folding import inference_view, weights_version
from mhe.attention.kernels import decode_plan
from mhe.attention.masks import as_bool_mask
from mhe.errors import MheError, checked_keywords
from mhe.generation.session import DecodeSession
from mhe.generation.step import check_compile_options, note_non_finite, refuse_non_finite, resolve_mode, restorer

__all__ = ["SOURCE_BUCKET", "WINDOW", "BeamSearcher", "BeamSession", "beam_search", "best_hypotheses",
           "length_penalty", "run_steps", "source_bucket"]
SESSIONS = 16  # shapes a searcher keeps buffers for, the newest
SOURCE_BUCKET = 32  # sources are padded (masked) to a multiple of this, so batches share a captured step
WINDOW = 16  # steps attend over (and reorder) the first multiple of this many target positions


def length_penalty(length: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT's ((5 + |Y|) / 6) ** alpha (Wu et al. 2016); alpha = 0 turns it off."""
    return ((5.0 + length.float()) / 6.0) ** alpha


def source_bucket(s: int) -> int:
    return -(-s // SOURCE_BUCKET) * SOURCE_BUCKET


@checked_keywords
@torch.no_grad()
def beam_search(model, src: torch.Tensor, src_mask: torch.Tensor | None = None, *, bos_id: int, eos_id: int,
                beam: int = 4, max_len: int = 100, alpha: float = 0.6, step_mode: str = "auto",
                compile_options: dict | None = None, return_scores: bool = False,
                searcher: "BeamSearcher | None" = None):
    """The best hypothesis per source, ``[B, L]`` starting with ``bos_id``, padded with ``eos_id``.

    Hypotheses are ranked by log-probability; finished ones (ending in EOS) keep their
    score; the final choice divides by the length penalty. ``beam=1`` is greedy search.
    ``searcher``: a :class:`BeamSearcher` to reuse across batches (its captured steps); None
    builds one from ``step_mode`` (see :mod:`mhe.generation.step`) and ``compile_options``.
    ``return_scores`` also returns each best hypothesis's length-normalised score ``[B]``.
    """
    src_mask = check_request(src, src_mask, beam=beam, max_len=max_len)
    searcher = searcher or BeamSearcher(model, step_mode=step_mode, compile_options=compile_options)
    tokens, scores = searcher.search(src, src_mask, bos_id=bos_id, eos_id=eos_id, beam=beam, max_len=max_len)
    out, best_score = best_hypotheses(tokens, scores, eos_id=eos_id, alpha=alpha)
    return (out, best_score) if return_scores else out


def check_request(src: torch.Tensor, src_mask: torch.Tensor | None, *, beam: int, max_len: int) -> torch.Tensor:
    """The boolean source mask of a checked request (all True when None): sources ``[B, S]`` of
    token ids with B, S >= 1, a mask of their shape with a real token in every row (as
    :func:`~mhe.generation.session.generate` asks of its prompts), ``beam >= 1`` and ``max_len >= 2``
    (the BOS and at least one token)."""
    shape = tuple(getattr(src, "shape", ()))
    if not isinstance(src, torch.Tensor) or src.dim() != 2 or 0 in shape or src.is_floating_point():
        raise MheError(f"src must be token ids [B, S] with at least one source of at least one token, got "
                       f"{'shape ' + str(shape) if isinstance(src, torch.Tensor) else type(src).__name__}")
    for name, value, least in (("beam", beam, 1), ("max_len", max_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise MheError(f"{name} must be an integer >= {least}, got {value!r}")
    if src_mask is None:
        return torch.ones_like(src, dtype=torch.bool)
    if tuple(getattr(src_mask, "shape", ())) != shape:
        raise MheError(f"src_mask must have the shape of src {shape}, got {tuple(getattr(src_mask, 'shape', ()))}")
    empty = (~as_bool_mask(src_mask)).all(1).nonzero().flatten().tolist()
    if empty:
        raise MheError(f"src_mask row {empty[0]} masks every source token; every source needs a real token")
    return src_mask


def best_hypotheses(tokens: torch.Tensor, scores: torch.Tensor, *, eos_id: int, alpha: float):
    """From hypotheses ``[B*k, L]`` and their scores ``[B, k]``: each source's best by score over
    the length penalty, ``[B, L']``, and that score ``[B]``. Everything after the first EOS becomes
    EOS, and columns after every row's first EOS are dropped, so the width does not depend on how
    often the search checked whether every hypothesis had finished."""
    b, beam = scores.shape
    dev = tokens.device
    is_eos = tokens[:, 1:] == eos_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1,
                        torch.full_like(is_eos[:, 0], tokens.shape[1] - 1, dtype=torch.long))
    final = scores.view(-1) / length_penalty(first, alpha)
    best_score, best = final.view(b, beam).max(1)
    out = tokens.reshape(b, beam, -1)[torch.arange(b, device=dev), best]
    after = torch.cumsum(out[:, 1:] == eos_id, 1) > 0
    out = torch.cat([out[:, :1], torch.where(after, torch.full_like(out[:, 1:], eos_id), out[:, 1:])], 1)
    width = int(first.view(b, beam)[torch.arange(b, device=dev), best].max()) + 1
    return out[:, :width], best_score


class BeamSearcher(DecodeSession):
    """What beam search keeps between batches, held by the caller: the view of ``model`` it
    decodes with and the captured steps (a :class:`~mhe.generation.session.DecodeSession` of the
    ``beam`` policy: ``auto`` replays the eager kernels as a CUDA graph, so an fp32 search gives
    exactly the eager search's translations), and one :class:`BeamSession` per shape (the
    :data:`SESSIONS` newest), all made again when the weights change."""

    policy = "beam"

    def __init__(self, model, *, step_mode: str = "auto", compile_options: dict | None = None) -> None:
        super().__init__(model, step_mode=step_mode, compile_options=check_compile_options(compile_options),
                         keep=SESSIONS * 8)
        self.step_mode, self.sessions = step_mode, {}

    def session(self, *, b: int, beam: int, src_len: int, max_len: int, eos_id: int) -> "BeamSession":
        model = self.model
        p = next(model.parameters())

        def make():  # new weights (or a new dtype or device): a new view, steps and sessions
            self.dtype, self.device = p.dtype, p.device
            self.mode = resolve_mode(self.step_mode, p.device, self.policy)
            self.plan = decode_plan(model, self.device, self.dtype, dense=True)  # masks of a window of the cache
            return inference_view(model)
        if self.build(weights_version(model), make):
            self.sessions = {}
        key = (b, beam, src_len, max_len, eos_id)
        if key not in self.sessions:
            if len(self.sessions) >= SESSIONS:
                self.runners.drop(lambda k, old=self.sessions.pop(next(iter(self.sessions))): k[0] == old.key)
            self.sessions[key] = BeamSession(self, key, src_len=src_len, max_len=max_len)
        return self.sessions[key]

    def search(self, src, src_mask, *, bos_id, eos_id, beam, max_len):
        """Hypotheses ``[B*k, L]`` and scores ``[B, k]``. When at most a quarter of a session's
        sources are still searching, the rest goes on in a smaller session (a power of two of
        sources; the finished ones are stored), so the longest translation of a large batch does
        not keep every row busy; a source's search is the same in any session."""
        b, s = src.shape
        dev = src.device
        session = self.session(b=b, beam=beam, src_len=source_bucket(s), max_len=max_len, eos_id=eos_id)
        memory = session.view.encode(src, src_mask).repeat_interleave(beam, 0)  # [B*k, S, m]
        session.start(memory, src_mask.repeat_interleave(beam, 0), bos_id)
        tokens = torch.full((b * beam, max_len), eos_id, dtype=torch.long, device=dev)
        scores = torch.zeros(b, beam, device=dev)
        ids = torch.arange(b, device=dev)  # the source of each of the session's sources (-1: a filler)
        t = 0
        while True:
            t = run_steps(session, t, max_len - 1, shrink=self.mode != "compile")
            session.check_finite()
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
            smaller = self.session(b=size, beam=beam, src_len=source_bucket(s), max_len=max_len, eos_id=eos_id)
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


class BeamSession:
    """Buffers for ``b`` sources x ``beam`` hypotheses of ``max_len`` (``key``: the searcher's key of
    this shape, ``(b, beam, src_len, max_len, eos_id)``); its steps live in the searcher's cache."""

    def __init__(self, searcher: BeamSearcher, key: tuple, *, src_len: int, max_len: int) -> None:
        b, beam, _, _, eos_id = key
        bk = b * beam
        view, dtype, device = searcher.view, searcher.dtype, searcher.device
        self.searcher, self.key = searcher, key
        self.view, self.b, self.beam, self.eos_id = view, b, beam, eos_id
        m, vocab = view.cfg.d_model, view.cfg.vocab_size
        self.memory = torch.zeros(bk, src_len, m, dtype=dtype, device=device)  # [B*k, S, m]
        self.src_mask = torch.zeros(bk, src_len, dtype=torch.bool, device=device)  # [B*k, S]
        self.caches = view.new_caches(bk, max_len, dtype=dtype, device=device)
        self.history = torch.zeros(bk, max_len, dtype=torch.long, device=device)  # tokens so far
        self.scores = torch.zeros(b, beam, device=device)
        self.finished = torch.zeros(bk, dtype=torch.bool, device=device)
        self.parents = torch.arange(bk, device=device)
        self.last = torch.zeros((), dtype=torch.long, device=device)  # position of the newest token
        self.n_active = torch.zeros((), dtype=torch.long, device=device)  # sources with an unfinished hypothesis
        self.bad_step = torch.zeros((), dtype=torch.long, device=device)  # first step of non-finite logits, or -1
        self.base = (torch.arange(b, device=device) * beam)[:, None]  # [B, 1]
        self.eos_only = torch.full((vocab,), float("-inf"), device=device)
        self.eos_only[eos_id] = 0.0  # a finished hypothesis only repeats EOS, at no cost
        self._state = (self.history, self.scores, self.finished, self.parents, self.last, self.n_active,
                       self.bad_step)
        self.mode, self.max_len = searcher.mode, max_len

    def start(self, memory: torch.Tensor, src_mask: torch.Tensor, bos_id: int) -> None:
        """Load one batch (``memory [B*k, S', m]``, ``S' <= S``) and store its cross-attention keys."""
        s = memory.shape[1]
        self.memory.zero_()
        self.memory[:, :s] = memory
        self.src_mask.zero_()
        self.src_mask[:, :s] = src_mask
        for self_cache, _ in self.caches:
            self_cache.reset()
        self.view.fill_cross_caches(self.memory, self.caches)
        self.history.zero_()
        self.history[:, 0] = bos_id
        self.scores.zero_()
        self.scores[:, 1:] = float("-inf")  # every beam starts as the same hypothesis: keep one
        self.finished.zero_()
        self.parents.copy_(torch.arange(self.parents.shape[0], device=self.parents.device))
        self.last.zero_()
        self.n_active.fill_(self.b)
        self.bad_step.fill_(-1)

    def take(self, other: "BeamSession", keep: torch.Tensor) -> None:
        """Continue the sources ``keep`` (``[self.b]`` indices, repeats allowed) of ``other`` at
        the same step: their encoder output, caches (with ``other``'s pending reorder applied),
        hypotheses and scores, so that the search goes on exactly as it would have there."""
        k = self.beam
        rows = (keep[:, None] * k + torch.arange(k, device=keep.device)).view(-1)  # [b*k] rows of other
        self.memory.copy_(other.memory.index_select(0, rows))
        self.src_mask.copy_(other.src_mask.index_select(0, rows))
        parents = other.parents.index_select(0, rows)
        for (mine, mine_x), (theirs, theirs_x) in zip(self.caches, other.caches):
            mine.kv.copy_(theirs.kv.index_select(1, parents))  # [2, B*k, h_kv, L, d]
            mine.index.copy_(theirs.index)
            mine_x.store(theirs_x.k.index_select(0, rows), theirs_x.v.index_select(0, rows))
        self.history.copy_(other.history.index_select(0, rows))
        self.scores.copy_(other.scores.index_select(0, keep))
        self.finished.copy_(other.finished.index_select(0, rows))
        self.parents.copy_(torch.arange(self.parents.shape[0], device=self.parents.device))
        self.last.copy_(other.last)
        self.bad_step.copy_(other.bad_step)
        self.n_active.copy_((~self.finished.view(self.b, k).all(1)).sum())

    def check_finite(self) -> None:
        """Refuse a search whose logits were not finite at some step (read once per run of steps)."""
        refuse_non_finite(self.bad_step, lambda s: f"beam search: the logits of step {s} (target position {s})",
                          "no hypothesis can be ranked")

    def window(self, t: int) -> int:
        """Self-attention positions step ``t`` (0-based; it writes position ``t``) runs over:
        ``t + 1`` rounded up to a multiple of :data:`WINDOW`, at most ``max_len``; the whole
        buffer when compiling (one compilation for every step)."""
        if self.mode == "compile":
            return self.max_len
        return min(-(-(t + 1) // WINDOW) * WINDOW, self.max_len)

    def advance(self, t: int) -> None:
        """Run step ``t``, with the step of its window (captured the first time it is needed; its
        warm-ups undone by a restore of the state it changes)."""
        w = self.window(t)

        def make():
            captured = self.mode != "eager" and self.searcher.device.type == "cuda"  # warm-ups to undo
            return self.searcher.new_runner(lambda: self.step(w), mode=self.mode,
                                            before_warmup=restorer(self._mutable()) if captured else None)
        self.searcher.runners.get((self.key, w), make)()

    def _mutable(self) -> list[torch.Tensor]:
        return list(self._state) + [self.caches[0][0].index] + [c.kv for c, _ in self.caches]

    def step(self, window: int) -> torch.Tensor:
        """One beam step over the first ``window`` target positions."""
        for self_cache, _ in self.caches:  # cross-attention keys are equal within a source's beams
            part = self_cache.kv[:, :, :, :window]  # [2, B*k, h_kv, window, d]
            part.copy_(part.index_select(1, self.parents))
        tok = self.history.gather(1, self.last.view(1, 1).expand(self.history.shape[0], 1))  # [B*k, 1]
        mask = masks.self_attention_mask(tok, None, start=self.caches[0][0].index, keys=window)
        logits = self.view.decode(tok, self.memory, self.src_mask, mask, caches=self.caches,
                                  plan=self.searcher.plan)[:, -1]
        broken = (~torch.isfinite(logits.float().amax(-1)) & ~self.finished).any()  # NaN, +inf or all -inf
        note_non_finite(self.bad_step, broken, self.last + 1)
        logp = F.log_softmax(logits.float(), -1)  # [B*k, V]
        logp = torch.where(self.finished[:, None], self.eos_only, logp)
        vocab = logp.shape[-1]
        cand = (self.scores.reshape(-1, 1) + logp).view(self.b, self.beam * vocab)
        scores, idx = cand.topk(self.beam, dim=1)  # [B, k]
        parents = (self.base + idx // vocab).view(-1)  # surviving parents
        new = (idx % vocab).view(-1, 1)  # [B*k, 1]
        history = self.history.index_select(0, parents)
        history.scatter_(1, (self.last + 1).view(1, 1).expand_as(new), new)
        self.finished.copy_(self.finished.index_select(0, parents) | (new.view(-1) == self.eos_id))
        self.history.copy_(history)
        self.scores.copy_(scores)
        self.parents.copy_(parents)
        self.last.add_(1)
        self.n_active.copy_((~self.finished.view(self.b, self.beam).all(1)).sum())
        return self.scores
