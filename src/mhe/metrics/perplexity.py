"""Perplexity with a sliding window (paper section 4.5: stride 256).

Windows of ``max_len`` tokens start every ``stride`` tokens; each window scores
only the tokens the previous window did not, so every token after the first is
scored exactly once, with up to ``max_len - stride`` tokens of extra context.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mhe.errors import MheError
from mhe.progress import bar


def window_plan(n_tokens: int, max_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, n_scored)`` per window: tokens ``[end - n_scored, end)`` are scored.

    Every token after the first is scored exactly once, and always by a window that
    also holds the token before it (so at most ``max_len - 1`` tokens per window). A
    stride equal to ``max_len`` therefore still overlaps consecutive windows by one token.
    """
    if stride <= 0 or stride > max_len:
        raise MheError(f"stride must be in 1..max_len={max_len}, got {stride}")
    if max_len < 2:
        raise MheError(f"perplexity windows need max_len >= 2, got {max_len}")
    plan, begin, done = [], 0, 1  # tokens [0, done) are handled; token 0 has no context
    while done < n_tokens:
        end = min(begin + max_len, n_tokens)
        plan.append((begin, end, end - done))
        done = end
        begin = min(begin + stride, done - 1)  # the next window starts no later than the last scored token
    return plan


@torch.no_grad()
def sliding_window_nll(model, ids: torch.Tensor, *, max_len: int, stride: int, batch_size: int = 16,
                       device=None, progress: bool = False) -> tuple[float, int]:
    """Total negative log-likelihood (nats) and number of scored tokens of a 1-D id stream;
    ``progress``: count the windows on a bar (standard error)."""
    device = device or next(model.parameters()).device
    plan = window_plan(ids.numel(), max_len, stride)
    total, count = 0.0, 0
    groups: dict[int, list] = {}
    for w in plan:
        groups.setdefault(w[1] - w[0], []).append(w)
    with bar(len(plan), desc=f"perplexity (stride {stride})", unit="window", enabled=progress) as shown:
        for length, windows in groups.items():
            for i in range(0, len(windows), batch_size):
                chunk = windows[i:i + batch_size]
                x = torch.stack([ids[b:e] for b, e, _ in chunk]).to(device)  # [W, L]
                first = length - 1 - max(n for _, _, n in chunk)  # earliest position any row scores
                if hasattr(model, "target_log_probs"):  # only the scored positions reach the output layer
                    logp = model.target_log_probs(x, first)  # [W, L-1-first]
                else:
                    logits = model(x).logits[:, first:-1]  # position t predicts t+1
                    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                    logp = F.log_softmax(logits, -1).gather(-1, x[:, first + 1:, None]).squeeze(-1)
                for row, (_, _, n) in enumerate(chunk):
                    total -= logp[row, logp.shape[1] - n:].sum().item()
                    count += n
                shown.update(len(chunk))
    return total, count


def perplexity(total_nll: float, count: int) -> float:
    return math.exp(total_nll / count)
