"""One beam-search shape's buffers and captured steps (:class:`BeamSession`), for
:mod:`mhe.models.beam_search`.

A step reorders the self-attention caches in place by the surviving parents, decodes the last
token of every hypothesis and does the beam bookkeeping on tensors, so that
:class:`~mhe.models.decode_step.StepRunner` captures it as one CUDA graph per window of target
positions (or compiles it once over the whole buffer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhe.attention import masks
from mhe.errors import MheError
from mhe.models.decode_step import StepRunner

WINDOW = 16  # steps attend over (and reorder) the first multiple of this many target positions


class BeamSession:
    """Buffers and the captured steps for ``b`` sources x ``beam`` hypotheses of ``max_len``."""

    def __init__(self, view, *, b: int, beam: int, src_len: int, max_len: int, eos_id: int, dtype, device,
                 mode: str, compile_options: dict | None) -> None:
        bk = b * beam
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
        self._saved: list[torch.Tensor] = []
        self.mode, self.max_len, self.device, self.compile_options = mode, max_len, torch.device(device), compile_options
        self.runners: dict[int, StepRunner] = {}  # window -> its step

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
        step = int(self.bad_step)
        if step >= 0:
            raise MheError(f"beam search: the logits of step {step} (target position {step}) are not finite "
                           "(NaN or inf): the model's weights or activations are; no hypothesis can be ranked")

    def window(self, t: int) -> int:
        """Self-attention positions step ``t`` (0-based; it writes position ``t``) runs over:
        ``t + 1`` rounded up to a multiple of :data:`WINDOW`, at most ``max_len``; the whole
        buffer when compiling (one compilation for every step)."""
        if self.mode == "compile":
            return self.max_len
        return min(-(-(t + 1) // WINDOW) * WINDOW, self.max_len)

    def advance(self, t: int) -> None:
        """Run step ``t``, with the step of its window (captured the first time it is needed)."""
        w = self.window(t)
        runner = self.runners.get(w)
        if runner is None:
            if self.mode == "graph":
                self._snapshot()  # capturing runs the step twice: undo it
            runner = self.runners[w] = StepRunner(lambda: self.step(w), [], mode=self.mode, device=self.device,
                                                  before_warmup=self._restore, compile_options=self.compile_options)
        runner()

    def _mutable(self) -> list[torch.Tensor]:
        return list(self._state) + [self.caches[0][0].index] + [c.kv for c, _ in self.caches]

    def _snapshot(self) -> None:
        self._saved = [t.clone() for t in self._mutable()]

    def _restore(self) -> None:
        for dst, src in zip(self._mutable(), self._saved):
            dst.copy_(src)

    def step(self, window: int) -> torch.Tensor:
        """One beam step over the first ``window`` target positions."""
        for self_cache, _ in self.caches:  # cross-attention keys are equal within a source's beams
            part = self_cache.kv[:, :, :, :window]  # [2, B*k, h_kv, window, d]
            part.copy_(part.index_select(1, self.parents))
        tok = self.history.gather(1, self.last.view(1, 1).expand(self.history.shape[0], 1))  # [B*k, 1]
        mask = masks.self_attention_mask(tok, None, start=self.caches[0][0].index, keys=window)
        logits = self.view.decode(tok, self.memory, self.src_mask, mask, caches=self.caches)[:, -1]
        broken = (~torch.isfinite(logits.float().amax(-1)) & ~self.finished).any()  # NaN, +inf or all -inf
        self.bad_step.copy_(torch.where((self.bad_step < 0) & broken, self.last + 1, self.bad_step))
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
