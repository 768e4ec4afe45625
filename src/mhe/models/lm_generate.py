"""Generation for the decoder: prefill the prompt, then one static decode step per token.

The prompt runs once through SDPA and fills a static KV cache; every new token is then one
call of the same decode step (``decode_step.StepRunner``: eager, a replayed CUDA graph, or
compiled once). Fast MHE sublayers are folded to MQA first (``decode_step.inference_view``),
and on a GPU one-K/V-head sublayers decode with the split-K ``flash-decode`` kernel
(``decode_step.decode_kernel``) unless the caller names a kernel.

Batches of prompts of different lengths are LEFT padded (``attention_mask`` 0 on the
left): positions count from each row's first real token and padding is never attended to,
so a row's continuation is the one it gets alone.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from mhe.attention import kernels
from mhe.errors import MheError, require_positive
from mhe.models.decode_step import (StepRunner, decode_kernel, inference_view, resolve_mode, restorer,
                                   weights_version)
from mhe.models.outputs import as_bool_mask
from mhe.models.sampling import SamplingConfig, next_token


class _Session:
    """Caches, the key mask and the captured step for one (batch, length) shape; reused across
    calls while the weights are unchanged."""

    def __init__(self, model, batch: int, length: int, dtype, device, mode: str, kernel: str | None) -> None:
        self.key = (batch, length, dtype, device, mode, kernel, weights_version(model))
        pick = None if kernel == "model" else (lambda attn: decode_kernel(attn, device, kernel))
        self.view = inference_view(model, pick)
        self.caches = self.view.new_caches(batch, length, dtype=dtype, device=device)
        self.key_mask = torch.ones(batch, length, dtype=torch.bool, device=device)  # [B, L]
        self.mode = mode
        self.runner: StepRunner | None = None

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` for tokens ``[B, 1]`` at positions ``[B, 1]``."""
        return self.view(tok, attention_mask=self.key_mask, caches=self.caches, position_ids=pos).logits[:, -1]

    def reset(self, prompt_mask: torch.Tensor) -> None:
        for c in self.caches:
            c.reset()
        self.key_mask.fill_(True)
        self.key_mask[:, :prompt_mask.shape[1]] = prompt_mask


def _session(model, batch, length, dtype, device, mode, kernel) -> _Session:
    """``kernel``: a kernel name for every sublayer, None for the automatic choice, or
    ``"model"`` for each sublayer's configured kernel."""
    s = model.__dict__.get("_generation_session")
    key = (batch, length, dtype, device, mode, kernel, weights_version(model))
    if s is None or s.key != key:
        model.__dict__["_generation_session"] = None  # free the old caches first
        s = model.__dict__["_generation_session"] = _Session(model, batch, length, dtype, device, mode, kernel)
    return s


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
             use_cache: bool = True, stop_ids: Sequence[int] = (), pad_id: int | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, streamer: Callable[[list[int]], None] | None = None,
             step_mode: str = "auto", compile_options: dict | None = None, decode_kernel: str | None = None,
             return_logits: bool = False):
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`~mhe.models.decoder.DecoderForCausalLM`.
        input_ids: prompts ``[B, P]``, left-padded when their lengths differ.
        attention_mask: ``[B, P]``, 1 for real tokens (0 for the left padding).
        use_cache: decode one token per step through a static KV cache (else re-read the
            whole sequence each step; for tests).
        stop_ids: tokens that end a row; the row then holds ``pad_id`` (default: the first
            stop token), and generation ends when every row has stopped.
        do_sample, temperature, top_k, top_p, seed: see :class:`SamplingConfig`.
        streamer: called after every step with the new token of each row.
        step_mode: ``auto`` (CUDA graph on a GPU, eager on a CPU), ``eager``, ``graph``,
            ``compile`` (see :mod:`mhe.models.decode_step`); ``compile_options`` go to
            ``torch.compile`` (e.g. ``{"backend": "aot_eager"}``).
        decode_kernel: the attention kernel of every sublayer while decoding
            (:data:`mhe.attention.kernels.KERNELS`). None (default): on CUDA, sublayers whose
            cache holds one K/V head and whose kernel is the default ``sdpa`` use
            ``flash-decode``, the others keep theirs; on a CPU nothing changes. Prompts whose
            mask is not left padding (a gap inside a row) keep the configured kernels.

    Returns:
        ``[B, P + n]`` token ids, the prompts followed by ``n <= max_new_tokens`` new tokens;
        with ``return_logits`` also the logits each new token was chosen from, ``[B, n, V]``.
    """
    require_positive(max_new_tokens=max_new_tokens)
    sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    b, p = input_ids.shape
    dev = input_ids.device
    total = p + max_new_tokens
    if total > model.cfg.max_len and model.cfg.positions in ("learned", "rotary"):  # tables of max_len positions
        raise MheError(f"prompt {p} + max_new_tokens {max_new_tokens} = {total} exceeds the model's "
                       f"max_len {model.cfg.max_len}")
    prompt_mask = torch.ones(b, p, dtype=torch.bool, device=dev) if attention_mask is None \
        else as_bool_mask(attention_mask).to(dev)
    if bool((~prompt_mask[:, -1]).any()):
        raise MheError("prompts must be left-padded: the last position of every row must be a real token")
    gen = sampling.generator(dev)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=dev)
    fill = pad_id if pad_id is not None else (int(stop_ids[0]) if len(stop_ids) else 0)
    positions = (prompt_mask.long().cumsum(1) - 1).clamp_min(0)  # [B, P] from each row's first real token
    nxt_pos = positions[:, -1:] + 1  # [B, 1]
    padded = attention_mask is not None and not bool(prompt_mask.all())

    if use_cache:
        dtype = next(model.parameters()).dtype
        # flash-decode reads one contiguous run of keys per row: true of left padding only
        kernel = decode_kernel if decode_kernel is not None or not padded or _left_padded(prompt_mask) else "model"
        if kernel is not None and kernel != "model":
            kernels.check_kernel(kernel)
        s = _session(model, b, total, dtype, dev, resolve_mode(step_mode, dev), kernel)
        s.reset(prompt_mask)
        logits = s.view(input_ids, attention_mask=s.key_mask if padded else None, caches=s.caches,
                        position_ids=positions, last_only=True).logits[:, -1]
        if not padded:
            s.key_mask.fill_(True)
        step = s.step if padded else (lambda tok, pos: s.view(tok, caches=s.caches, position_ids=pos).logits[:, -1])
        if s.runner is None or s.runner.mode != s.mode or getattr(s.runner, "padded", None) != padded:
            s.runner = StepRunner(step, [input_ids[:, -1:], nxt_pos], mode=s.mode, before_warmup=restorer(s.caches),
                                  compile_options=compile_options)
            s.runner.padded = padded
        run = s.runner
    else:
        logits = model(input_ids, attention_mask=prompt_mask, position_ids=positions, last_only=True).logits[:, -1]

    out, seen = [input_ids], []
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    seq, seq_mask, seq_pos = input_ids, prompt_mask, positions
    for i in range(max_new_tokens):
        if return_logits:
            seen.append(logits.clone())  # the runner's output tensor is reused by the next step
        tok = next_token(logits, sampling, gen)  # [B]
        tok = torch.where(done, torch.full_like(tok, fill), tok)
        if len(stops):
            done = done | torch.isin(tok, stops)
        out.append(tok[:, None])
        if streamer is not None:
            streamer(tok.tolist())
        if i == max_new_tokens - 1 or (len(stops) and (i % 8 == 7 or streamer is not None) and bool(done.all())):
            break
        pos = nxt_pos + i
        if use_cache:
            logits = run(tok[:, None], pos)
        else:
            seq = torch.cat([seq, tok[:, None]], 1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(tok[:, None], dtype=torch.bool)], 1)
            seq_pos = torch.cat([seq_pos, pos], 1)
            logits = model(seq, attention_mask=seq_mask, position_ids=seq_pos).logits[:, -1]
    tokens = torch.cat(out, 1)
    return (tokens, torch.stack(seen, 1)) if return_logits else tokens


def _left_padded(prompt_mask: torch.Tensor) -> bool:
    """Every row is padding, then real tokens (reads the device)."""
    return bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all())


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and mask, padded on the left (generation continues at the right edge)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask
