"""The least-squares fits behind ``mhe convert``, on one role's heads at a time.

Notation (paper section 3): m model width, n heads, d head width. A head's projection is
taken in the paper's orientation, W_i in R^{m x d} (Q_i = X W_i), with its bias appended as
one more row, A_i = [W_i; b_i] in R^{p x d} with p = m + 1, so that [X, 1] A_i = X W_i + 1 b_i^T.
The functions take the heads stacked as ``a: [n, p, d]`` (float64) and return new tensors.

* :func:`rank1_scales`: MHE-Mul, A_i ~ W diag(s_i) with s_i = 1 + e_i (section 3.4).
* :func:`group_means`: MQA/GQA, the mean of the heads of each group (Ainslie et al. 2023, 2.2);
  the same mean is MHE-Add's shared projection.
* :func:`procrustes`: the orthogonal rotation that best aligns one head with a target
  (Schoenemann 1966), used to align heads before they are merged; :func:`rotary_procrustes`,
  the same restricted to the rotations that commute with RoPE (one plane rotation per rotary
  pair, any orthogonal map of the unrotated dimensions).
* :func:`relative_error`: how far fitted heads are from the originals, in weight space or on
  calibration inputs.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor


@contextlib.contextmanager
def small_solves(device: torch.device):
    """Run a conversion's fits (thousands of small float64 factorisations) well on ``device``.

    On the CPU, with one thread: each factorisation is too small to share, and LAPACK's threads
    spin-wait on each other when other processes hold the cores (measured on 2 busy cores, one
    batched SVD of 32 matrices of 1026 x 8 took 3.8 s with 2 threads and 3 ms with one). On a GPU,
    with cuSOLVER (torch may otherwise pick MAGMA, whose hybrid solvers run part of the work
    through the host's LAPACK). The previous settings are restored afterwards."""
    if device.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
    elif device.type == "cuda":
        backend = torch.backends.cuda.preferred_linalg_library()
        torch.backends.cuda.preferred_linalg_library("cusolver")
        try:
            yield
        finally:
            torch.backends.cuda.preferred_linalg_library(backend)
    else:
        yield


def rank1_scales(a: Tensor, groups: list[list[int]] | None = None) -> tuple[Tensor, Tensor]:
    """The MHE-Mul fit: W ``[p, d]`` and scales s ``[n, d]`` minimising
    sum_i ||A_i - W diag(s_i)||_F^2 exactly.

    Column j of every head must be a multiple s_ij of one shared column w_j, so the
    objective splits over columns: stacking the n heads' j-th columns gives a p x n matrix
    M_j ~ w_j s_j^T, whose best rank-1 approximation (Eckart-Young) is sigma_1 u_1 v_1^T
    (its leading singular triplet, :func:`top_singular`). The scale of (w_j, s_j) is free; we fix ||s_j|| = sqrt(n) (root mean square
    one over the heads) with sum_i s_ij >= 0. A mean of one, the other natural choice, is
    ill-conditioned: heads trained independently have columns that nearly cancel, so their
    mean can be close to zero and the scales unbounded; the root mean square never is.

    Args:
        a: the heads ``[n, p, d]``.
        groups: columns that must share one scale, e.g. the two dimensions of a rotary pair
            (a rotation commutes with a scale only when it is equal within the pair); their
            columns are stacked into one vector of length ``len(group) * p``. Default: every
            column on its own.
    """
    n, p, d = a.shape
    groups = groups or [[j] for j in range(d)]
    w = torch.zeros(p, d, dtype=a.dtype, device=a.device)
    s = torch.ones(n, d, dtype=a.dtype, device=a.device)
    by_size: dict[int, list[list[int]]] = {}
    for g in groups:
        by_size.setdefault(len(g), []).append(list(g))
    for size, gs in by_size.items():
        idx = torch.tensor(gs, device=a.device)  # [G, size]
        mats = a[:, :, idx].permute(2, 3, 1, 0).reshape(len(gs), size * p, n)  # [G, size*p, n]
        u, sig, v = top_singular(mats)  # [G, size*p], [G], [G, n]
        sign = torch.where(v.sum(1) >= 0, 1.0, -1.0).to(a.dtype)  # [G]
        scale = sign * math.sqrt(n)
        s_g = v * scale[:, None]  # [G, n]
        w_g = u * (sig / scale)[:, None]  # [G, size*p]: w s^T = sigma u v^T
        w_g = torch.where(sig[:, None] > 0, w_g, torch.zeros_like(w_g))
        s_g = torch.where(sig[:, None] > 0, s_g, torch.ones_like(s_g))
        w[:, idx] = w_g.view(len(gs), size, p).permute(2, 0, 1)  # [p, G, size]
        s[:, idx] = s_g.T[:, :, None].expand(n, len(gs), size)
    return w, s


def top_singular(mats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The leading singular triplet (u ``[G, r]``, sigma ``[G]``, v ``[G, n]``) of each tall, thin
    ``mats`` ``[G, r, n]`` (r >> n, e.g. 1026 x 8), from the n x n Gram matrix M^T M = V S^2 V^T:
    v its top eigenvector, sigma the root of its eigenvalue and u = M v / sigma.

    Why not an SVD: a batched SVD of such matrices is one LAPACK call per matrix (and on a CPU
    shared with other work its threads wait on each other: :func:`small_solves`), while the Gram
    matrices are one batched product and an eigensolver of n x n, several times cheaper.
    Squaring M halves the digits of the small singular values, not of the leading triplet: the
    leading triplet's error is about eps sigma_1^2 / (sigma_1^2 - sigma_2^2) either way, and an
    exactly rank-1 M (a planted MHE source) is recovered to rounding. u is zero where sigma is."""
    lam, vec = torch.linalg.eigh(mats.transpose(1, 2) @ mats)  # ascending eigenvalues
    v = vec[:, :, -1]  # [G, n]
    sig = lam[:, -1].clamp(min=0).sqrt()  # [G]
    u = (mats @ v[:, :, None])[:, :, 0] / torch.where(sig > 0, sig, torch.ones_like(sig))[:, None]
    return u, sig, v


def group_means(a: Tensor, groups: int) -> Tensor:
    """The mean of each of ``groups`` runs of consecutive heads: ``[n, p, d] -> [groups, p, d]``
    (head i belongs to group i // (n / groups), as GQA groups its query heads)."""
    n = a.shape[0]
    return a.reshape(groups, n // groups, *a.shape[1:]).mean(1)


def expand_groups(g: Tensor, n: int) -> Tensor:
    """``[groups, ...] -> [n, ...]``: each group's entry repeated for its n / groups heads."""
    return g.repeat_interleave(n // g.shape[0], dim=0)


def procrustes(c: Tensor) -> Tensor:
    """The orthogonal R maximising tr(R^T C) for each ``C`` of ``c: [u, d, d]``, i.e. minimising
    ||A R - T||_F when C = A^T T (orthogonal Procrustes, Schoenemann 1966): R = U V^T from
    C = U S V^T."""
    u, _, vh = torch.linalg.svd(c)
    return u @ vh


def rotary_procrustes(c: Tensor, width: int) -> Tensor:
    """The R maximising tr(R^T C) for each ``C`` of ``c: [u, d, d]`` among the rotations that
    commute with RoPE on the first ``width`` = r dimensions (``rotate_half`` pairs (j, j + r/2)).

    RoPE turns each pair's plane by a position-dependent angle, so R may only be block-diagonal:
    a plane rotation [[cos a, -sin a], [sin a, cos a]] on each pair (2-D rotations commute; a
    reflection does not) and any orthogonal block on the d - r unrotated dimensions. The
    objective splits over the blocks: on a pair it is cos a (C_jj + C_kk) + sin a (C_kj - C_jk)
    (k = j + r/2), largest at a = atan2(C_kj - C_jk, C_jj + C_kk); on the rest, :func:`procrustes`.
    """
    half = width // 2
    j, k = torch.arange(half, device=c.device), torch.arange(half, width, device=c.device)
    angle = torch.atan2(c[:, k, j] - c[:, j, k], c[:, j, j] + c[:, k, k])  # [u, r/2]
    r = torch.zeros_like(c)
    r[:, j, j], r[:, k, k] = angle.cos(), angle.cos()
    r[:, j, k], r[:, k, j] = -angle.sin(), angle.sin()
    if width < c.shape[-1]:
        r[:, width:, width:] = procrustes(c[:, width:, width:])
    return r


def relative_error(original: Tensor, fitted: Tensor, gram: Tensor | None = None) -> float:
    """sqrt(sum_i ||A_i - F_i||^2 / sum_i ||A_i||^2) over heads ``[n, p, d]``.

    With ``gram`` G = E[x x^T] over calibration inputs x = [token, 1] (``[p, p]``), the norms
    are those of the projected outputs, ||A||^2 = tr(A^T G A), i.e. the error of X A_i itself."""
    diff = original - fitted
    if gram is None:
        num, den = diff.pow(2).sum(), original.pow(2).sum()
    else:
        num = torch.einsum("npd,pq,nqd->", diff, gram, diff)
        den = torch.einsum("npd,pq,nqd->", original, gram, original)
    return math.sqrt(max(float(num), 0.0) / float(den)) if float(den) > 0 else 0.0


def low_rank_factors(mat: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """L ``[a, rank]`` and R ``[b, rank]`` with L R^T the best rank-``rank`` approximation of
    ``mat`` ``[a, b]`` in Frobenius norm (Eckart-Young), split evenly: U S^1/2 and V S^1/2."""
    u, s, vh = torch.linalg.svd(mat, full_matrices=False)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, vh[:rank].T * root


def sqrt_psd(g: Tensor) -> Tensor:
    """The symmetric square root of a positive semi-definite matrix (a second moment)."""
    lam, vec = torch.linalg.eigh(g)
    return (vec * lam.clamp(min=0).sqrt()) @ vec.T


def product_error(a1: Tensor, a2: Tensor, f1: Tensor, f2: Tensor, root1: Tensor | None = None,
                  root2: Tensor | None = None) -> float:
    """sqrt(sum_i ||A1_i A2_i^T - F1_i F2_i^T||^2 / sum_i ||A1_i A2_i^T||^2) over heads (``[n, *, d]``
    each). It measures what a head computes: its logits' bilinear form (query, key) or its
    value-to-output map. ``root1``/``root2``: square roots of the second moments that weigh the
    rows/columns (calibration inputs; None: identity). The products are never formed: the
    difference is [A1, -F1] [A2, F2]^T, and after a QR of the left factor its norm is that of a
    2d-row matrix, without the cancellation of expanding the square."""
    def norm2(left: Tensor, right: Tensor) -> float:
        if root1 is not None:
            left = root1 @ left
        if root2 is not None:
            right = root2 @ right
        _, r = torch.linalg.qr(left)  # left = Q r, Q with orthonormal columns
        return float((r @ right.transpose(1, 2)).pow(2).sum())

    den = norm2(a1, a2)
    num = norm2(torch.cat([a1, -f1], -1), torch.cat([a2, f2], -1))
    return math.sqrt(num / den) if den > 0 else 0.0
