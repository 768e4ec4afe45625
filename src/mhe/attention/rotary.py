"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", section 3.4).

The query and key of every head are rotated by an angle proportional to their position, so
their dot product depends on the positions only through their difference. Dimension pairs
follow the "half-split" convention of the Llama, Qwen2 and Mistral models in Hugging Face
``transformers`` (``rotate_half``): dimension ``i`` is paired with ``i + r/2``, where ``r`` is
the rotary width, and the pair is rotated by ``theta_i = position * base^(-2i/r)``, ``i <
r/2``. With ``fraction < 1`` only the first ``r = fraction * d`` dimensions of each head are
rotated and the rest pass through (partial rotary, as GPT-NeoX and Phi use it).

The angles and their cosines and sines are computed in float32, as Llama's released code and
``transformers`` compute them (``inv_freq`` in float32, ``position * inv_freq`` in float32),
then cast to the activations' dtype: an imported checkpoint sees exactly the constants it was
trained with, in every dtype. The table covers positions ``0 .. max_len - 1`` and is computed
once, on the device the module is moved to.

The module holds no weights (nothing in a ``state_dict``); one instance serves every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention.options import rotary_width  # noqa: F401 (re-exported: the rotated width)
from mhe.errors import MheError, require_positive


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates ``[B, h, T, d]`` queries or keys by their positions.

    Args:
        head_dim: per-head width d.
        base: the wavelength base (``rope_theta``; 10000 in RoFormer and Llama).
        fraction: the share of each head that is rotated (1: all of it).
        max_len: positions covered by the cos/sin table.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, fraction: float = 1.0, max_len: int = 2048) -> None:
        super().__init__()
        require_positive(head_dim=head_dim, max_len=max_len)
        if not base > 1.0:
            raise MheError(f"rope_base must be a number above 1, got {base!r}")
        self.head_dim, self.base, self.fraction, self.max_len = head_dim, float(base), fraction, max_len
        self.width = rotary_width(head_dim, fraction)
        # a plain attribute, not a buffer: it is not a weight, and loaders that build models on
        # the meta device leave buffers empty; ``_apply`` rebuilds it where the module goes
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._build(torch.device("cpu"))  # an explicit device: real values even under a meta-device context

    def inverse_frequencies(self) -> torch.Tensor:
        """``base^(-2i/r)`` for ``i < r/2``, float32 ``[r/2]`` (Llama's ``inv_freq``)."""
        r = self.width
        return 1.0 / (self.base ** (torch.arange(0, r, 2, dtype=torch.int64, device="cpu").float() / r))

    def _build(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(self.max_len, dtype=torch.int64, device="cpu").float()  # [L]
        angles = pos[:, None] * self.inverse_frequencies()[None, :]  # [L, r/2], float32
        angles = torch.cat((angles, angles), dim=-1)  # [L, r]: pair (i, i + r/2) shares theta_i
        self._table = (angles.cos().to(device), angles.sin().to(device))
        return self._table

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin: [max_len, r]`` float32 on ``device``."""
        t = self._table
        return t if t is not None and t[0].device == device else self._build(device)

    def _apply(self, fn, recurse=True):
        # ``.to(device)`` / ``.cuda()``: rebuild the float32 table where tensors are sent
        target = fn(torch.zeros((), device=self._table[0].device if self._table else "cpu")).device
        if target.type != "meta" and (self._table is None or self._table[0].device != target):
            self._build(target)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x: [B, h, T, d]`` rotated by ``positions`` (``[B, T]`` or ``[T]``, integers in
        ``0 .. max_len - 1``)."""
        cos, sin = self.table(x.device)
        cos, sin = cos[positions], sin[positions]  # [B, T, r] or [T, r]
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, r]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        r = self.width
        if r == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, keep = x[..., :r], x[..., r:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, keep), dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotated={self.width}, base={self.base:g}, max_len={self.max_len}"
