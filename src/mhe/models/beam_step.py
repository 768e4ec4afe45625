"""Beam search state with static shapes: the whole beam step is one graph.

One step reorders the self-attention caches in place by the surviving parents, decodes the
last token of every hypothesis, and does the beam bookkeeping (log-softmax, finished
hypotheses only extend with EOS at no cost, top-k over beam x vocabulary, the token
history) on tensors, so ``decode_step.StepRunner`` can replay it as a CUDA graph or compile it
once. A session keeps its buffers and captured steps for one shape (rows, beam, source length
rounded up to a multiple of 32) and is reused by later batches of that shape: capturing (and
cuDNN planning a new attention shape) costs far more than a step, so few shapes pay off. Each
step attends over (and reorders) only the first ``WINDOW``-multiple of target positions that
holds its token (one captured step per window, made when first needed), not the whole
``max_len`` buffer: a 20-token translation's steps read 16 or 32 positions, not 100.
:func:`decode_kernel` picks the decoder's attention kernel for one-token steps: in fp32 on CUDA
the explicit softmax (``eager-one-token``), since SDPA has no fast fp32 one-query kernel; the
encoder keeps the model's kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import copy
import dataclasses

from mhe.models.decode_step import StepRunner, inference_view, weights_version

SOURCE_BUCKET = 32  # sources are padded (masked) to a multiple of this, so batches share a captured step
WINDOW = 16  # steps attend over (and reorder) the first multiple of this many target positions


def source_bucket(s: int) -> int:
    return -(-s // SOURCE_BUCKET) * SOURCE_BUCKET


def decode_kernel(model, dtype: torch.dtype, device) -> str | None:
    """``eager-one-token`` for an fp32 model with the ``sdpa`` kernel on CUDA, else None (keep it)."""
    if torch.device(device).type == "cuda" and dtype == torch.float32 and model.cfg.attn_kernel == "sdpa":
        return "eager-one-token"
    return None


def with_decoder_kernel(view, kernel: str | None):
    """``view`` whose decoder attention sublayers run ``kernel`` (same function, another way of
    computing it); parameters and buffers are shared, the encoder is untouched."""
    if kernel is None:
        return view
    memo = {id(t): t for t in list(view.parameters()) + list(view.buffers())}
    out = copy.deepcopy(view, memo)
    for m in out.decoder_layers.modules():
        cfg = getattr(m, "cfg", None)
        if dataclasses.is_dataclass(cfg) and hasattr(cfg, "kernel"):
            m.cfg = dataclasses.replace(cfg, kernel=kernel)
    return out.eval()


class BeamSession:
    """Buffers and the captured step for ``b`` sources x ``beam`` hypotheses of ``max_len``."""

    def __init__(self, view, *, b: int, beam: int, src_len: int, max_len: int, eos_id: int, dtype, device,
                 mode: str, compile_options: dict | None) -> None:
        bk = b * beam
        self.view, self.b, self.beam, self.eos_id = view, b, beam, eos_id
        m, vocab = view.cfg.d_model, view.cfg.vocab_size
        self.memory = torch.zeros(bk, src_len, m, dtype=dtype, device=device)  # [B*k, S, m]
        self.src_mask = torch.zeros(bk, src_len, dtype=torch.bool, device=device)  # [B*k, S]
        self.caches = view.new_caches(bk, max_len, src_len, dtype=dtype, device=device)
        self.history = torch.zeros(bk, max_len, dtype=torch.long, device=device)  # tokens so far
        self.scores = torch.zeros(b, beam, device=device)
        self.finished = torch.zeros(bk, dtype=torch.bool, device=device)
        self.parents = torch.arange(bk, device=device)
        self.last = torch.zeros((), dtype=torch.long, device=device)  # position of the newest token
        self.n_active = torch.zeros((), dtype=torch.long, device=device)  # sources with an unfinished hypothesis
        self.base = (torch.arange(b, device=device) * beam)[:, None]  # [B, 1]
        self.eos_only = torch.full((vocab,), float("-inf"), device=device)
        self.eos_only[eos_id] = 0.0  # a finished hypothesis only repeats EOS, at no cost
        self._state = (self.history, self.scores, self.finished, self.parents, self.last, self.n_active)
        self._saved: list[torch.Tensor] = []
        self.mode, self.max_len, self.device, self.compile_options = mode, max_len, torch.device(device), compile_options
        self.runners: dict[int, StepRunner] = {}  # window -> its step

    def start(self, memory: torch.Tensor, src_mask: torch.Tensor, bos_id: int) -> None:
        """Load one batch (``memory [B*k, S', m]``, ``S' <= S``) and fill the cross-attention caches."""
        s = memory.shape[1]
        self.memory.zero_()
        self.memory[:, :s] = memory
        self.src_mask.zero_()
        self.src_mask[:, :s] = src_mask
        for self_cache, cross_cache in self.caches:
            self_cache.reset()
            self_cache.window = 0
            cross_cache.reset()
        self.history.zero_()
        self.history[:, 0] = bos_id
        self.view.decode(self.history[:, :1], self.memory, self.src_mask, caches=self.caches)  # fills cross caches
        for self_cache, _ in self.caches:
            self_cache.reset()
            self_cache.fresh = False  # every step, the first included, is the same full-buffer step
        self.scores.zero_()
        self.scores[:, 1:] = float("-inf")  # every beam starts as the same hypothesis: keep one
        self.finished.zero_()
        self.parents.copy_(torch.arange(self.parents.shape[0], device=self.parents.device))
        self.last.zero_()
        self.n_active.fill_(self.b)

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
            mine.k.copy_(theirs.k.index_select(0, parents))
            mine.v.copy_(theirs.v.index_select(0, parents))
            mine.index.copy_(theirs.index)
            mine.fresh, mine.window = False, 0
            mine_x.k.copy_(theirs_x.k.index_select(0, rows))
            mine_x.v.copy_(theirs_x.v.index_select(0, rows))
            mine_x.index.copy_(theirs_x.index)
            mine_x.filled, mine_x.fresh = theirs_x.filled, theirs_x.fresh
        self.history.copy_(other.history.index_select(0, rows))
        self.scores.copy_(other.scores.index_select(0, keep))
        self.finished.copy_(other.finished.index_select(0, rows))
        self.parents.copy_(torch.arange(self.parents.shape[0], device=self.parents.device))
        self.last.copy_(other.last)
        self.n_active.copy_((~self.finished.view(self.b, k).all(1)).sum())

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
            runner = self.runners[w] = StepRunner(lambda: self._windowed_step(w), [], mode=self.mode, device=self.device,
                                                  before_warmup=self._restore, compile_options=self.compile_options)
        runner()

    def _windowed_step(self, window: int) -> torch.Tensor:
        for self_cache, _ in self.caches:
            self_cache.window = window
        return self.step()

    def _mutable(self) -> list[torch.Tensor]:
        return list(self._state) + [t for c, _ in self.caches for t in (c.index, c.k, c.v)]

    def _snapshot(self) -> None:
        self._saved = [t.clone() for t in self._mutable()]

    def _restore(self) -> None:
        for dst, src in zip(self._mutable(), self._saved):
            dst.copy_(src)

    def step(self) -> torch.Tensor:
        for self_cache, _ in self.caches:  # cross-attention caches are equal within a source's beams
            self_cache.reorder(self.parents)
        tok = self.history.gather(1, self.last.view(1, 1).expand(self.history.shape[0], 1))  # [B*k, 1]
        logits = self.view.decode(tok, self.memory, self.src_mask, caches=self.caches)[:, -1]
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


def beam_session(model, *, b, beam, src_len, max_len, eos_id, dtype, device, mode, compile_options) -> BeamSession:
    """A cached session for this shape, rebuilt when the weights change."""
    version = weights_version(model)
    kernel = decode_kernel(model, dtype, device)
    store = model.__dict__.get("_beam_sessions")
    if store is None or store["version"] != version or store["kernel"] != kernel:
        model.__dict__["_beam_sessions"] = None
        view = with_decoder_kernel(inference_view(model), kernel)
        store = model.__dict__["_beam_sessions"] = {"version": version, "kernel": kernel, "view": view, "by_shape": {}}
    key = (b, beam, src_len, max_len, eos_id, dtype, str(device), mode, repr(compile_options))
    sessions = store["by_shape"]
    if key not in sessions:
        if len(sessions) >= 16:
            sessions.pop(next(iter(sessions)))
        sessions[key] = BeamSession(store["view"], b=b, beam=beam, src_len=src_len, max_len=max_len, eos_id=eos_id,
                                    dtype=dtype, device=device, mode=mode, compile_options=compile_options)
    return sessions[key]
