"""Token-mixing baselines of Lee-Thorp et al. (2022): FNet and Linear (paper Appendix A).

They replace the attention sublayer and have no keys, values or heads, so
they take no context (no cross-attention) and keep no KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention.base import Attention, AttentionConfig
from mhe.attention.kv_cache import KVCache
from mhe.attention import masks
from mhe.attention.masks import AttentionMask
from mhe.errors import MheError


class _Mixing(Attention):
    supports_cache = False
    supports_cross = False

    def forward(self, x, *, positions=None, context=None, mask=None, cache: KVCache | None = None, plan=None):
        """``positions`` and ``plan`` are accepted and unused: mixing has no queries or keys to
        rotate and runs no attention kernel."""
        if context is not None:
            raise MheError(f"attention kind {self.kind!r} mixes tokens of one sequence and cannot cross-attend")
        if cache is not None:
            raise MheError(f"attention kind {self.kind!r} mixes whole sequences and has no KV cache")
        self._check_input(x, None)
        if isinstance(mask, AttentionMask):  # built by the model: mix by the key-padding mask it came from
            mask = mask.padding
        key_mask = masks.checked_key_mask(mask, x.shape[0], x.shape[1])
        if key_mask is not None:
            x = x * key_mask[..., None].to(x.dtype)  # padding does not leak into real tokens
        return self._mix(x)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FNetMixing(_Mixing):
    """FNet: Re(FFT_seq(FFT_hidden(x))), no parameters (Lee-Thorp et al. 2022, Eq. 3).

    A Fourier transform over the sequence sees every position, so FNet cannot be causal.
    """

    def __init__(self, cfg: AttentionConfig, *, kind: str | None = None) -> None:
        if cfg.causal:
            raise MheError("attention kind 'fnet' mixes the whole sequence and cannot be causal; use it in encoders")
        super().__init__(cfg, kind=kind)

    def _mix(self, x):
        dtype = x.dtype
        y = torch.fft.fft2(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, dim=(-2, -1)).real
        return y.to(dtype)


class LinearMixing(_Mixing):
    """Linear mixing: Y = W_seq X W_hidden (Lee-Thorp et al. 2022).

    Dense matrices along the sequence (``seq_mix``, max_len x max_len, the
    leading T x T block is used) and the hidden dimension (``hidden_mix``, m x m).
    With ``causal`` the sequence matrix is lower-triangular.
    Parameters: max_len^2 + m^2 (+ m with bias).
    """

    def __init__(self, cfg: AttentionConfig, *, kind: str | None = None) -> None:
        super().__init__(cfg, kind=kind)
        self.max_len = cfg.options.resolved_max_len
        self.seq_mix = nn.Parameter(torch.empty(self.max_len, self.max_len))
        self.hidden_mix = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        nn.init.normal_(self.seq_mix, std=self.max_len ** -0.5)

    def _mix(self, x):
        t = x.shape[1]
        if t > self.max_len:
            raise MheError(f"sequence length {t} exceeds the linear mixer's max_len {self.max_len}")
        w = self.seq_mix[:t, :t]
        if self.cfg.causal:
            w = torch.tril(w)
        return self.hidden_mix(torch.einsum("st,btm->bsm", w, x))
