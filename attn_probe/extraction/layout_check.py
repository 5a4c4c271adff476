"""Check a layer's reading against what its forward hands to attention (issue 44, "What to build" 1).

The probe reads each layer as per-head factors ``W_q (H, dh, d)`` and ``W_k (Hkv, dh, d)`` with query head
``h`` on key head ``h // (H / Hkv)`` (:class:`~attn_probe.extraction.base.AttentionLayer`). Whether that
reading is the model's is decided here from one forward: the tokens ``x`` the projections read and the
``q``/``k`` the attention call received for them (sdpa, transformers' interface or flex), per position and
head. Rotary embeddings rotate ``q_i`` and ``k_i`` by the same angle, so only what a rotation keeps is
compared: per-position head norms and the diagonal logit ``q_i . k_i``, each fitted per head by least
squares so that a constant scale (a pre-scaled query) and a projection bias (outside ``W_qk``) are allowed.

:func:`check_layout` tries both standard pairings, *grouped* (``h // (H / Hkv)``: transformers'
``repeat_kv``, torch's ``enable_gqa``) and *tiled* (``h % Hkv``: x-transformers), and reports ``ok`` (the
probe's grouped reading fits), ``tiled`` (only the tiled pairing fits), ``mismatch`` (neither; the line
names the fits that failed: the query rows, the keys, the diagonal logits) or ``unverified`` (too few
tokens). A transform after the projection (QK-norm) is the caller's to pass (``q_post``/``k_post``: the
module's own norms); it is reported in the line, as the docs leave it out of ``W_qk``.

Pure torch, float64, no state: the caller owns capture, warnings and the run header.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

PAIRINGS = ("grouped", "tiled")

#: the default tolerance of a fit's relative residual by the least precise input dtype (others: float16's)
TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def key_heads(pairing: str, num_heads: int, num_kv_heads: int) -> Tensor:
    """The key head each query head meets: ``grouped`` ``h // (H / Hkv)``, ``tiled`` ``h % Hkv``.

    Example:
        >>> key_heads("grouped", 4, 2).tolist(), key_heads("tiled", 4, 2).tolist()
        ([0, 0, 1, 1], [0, 1, 0, 1])
    """
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} key heads")
    heads = torch.arange(num_heads)
    if pairing == "grouped":
        return heads // (num_heads // num_kv_heads)
    if pairing == "tiled":
        return heads % num_kv_heads
    raise ValueError(f"pairing must be one of {PAIRINGS}, not {pairing!r}")


@dataclass(frozen=True)
class LayoutCheck:
    """The result of :func:`check_layout`."""

    #: ``ok``, ``tiled``, ``mismatch`` or ``unverified`` (too few tokens to decide)
    verdict: str
    #: the standard pairings the forward fits (both when they coincide: ``Hkv`` in ``{1, H}``)
    fits: tuple[str, ...]
    #: the constant factor of the forward's ``q . k`` over the probe's (``None`` unless a pairing fits)
    scale: float | None
    #: one line for a warning or the run header
    line: str
    #: the worst relative residual of each test: ``q`` norms, then ``k`` norms and diagonal logits per pairing
    residuals: dict[str, float]


def _fit(target: Tensor, features: list[Tensor]) -> tuple[float, Tensor]:
    """Per-head least squares ``target (N, H) ~ features (N, H, F)``: the worst relative residual over the
    heads and the coefficients ``(H, F)``."""
    a = torch.cat([f if f.dim() == 3 else f[..., None] for f in features], -1).transpose(0, 1)  # (H, N, F)
    b = target.transpose(0, 1)[..., None]  # (H, N, 1)
    coef = torch.linalg.lstsq(a, b).solution
    resid = (a @ coef - b).abs().amax(dim=(1, 2)) / b.abs().amax(dim=(1, 2)).clamp_min(
        torch.finfo(b.dtype).tiny
    )
    return float(resid.max()), coef[..., 0]


def _direct(target: Tensor, value: Tensor) -> float:
    """The worst relative difference per head of ``value (N, H)`` from ``target``: the fit's residual when the
    forward adds no bias and no factor (the usual case), exact however few distinct tokens there are."""
    scale = target.abs().amax(dim=0).clamp_min(torch.finfo(target.dtype).tiny)
    return float(((value - target).abs().amax(dim=0) / scale).max())


def check_layout(
    x: Tensor,
    query: Tensor,
    key: Tensor,
    q_seen: Tensor,
    k_seen: Tensor,
    *,
    q_post: Callable[[Tensor], Tensor] | None = None,
    k_post: Callable[[Tensor], Tensor] | None = None,
    tol: float | None = None,
    max_tokens: int | None = 4096,
) -> LayoutCheck:
    """Whether the factors ``query (H, dh, d)``, ``key (Hkv, dh, d)`` reproduce the forward's ``q``/``k``.

    ``x (N, d)``: the tokens the projections read (batch and positions flattened); ``q_seen (N, H, dh)``,
    ``k_seen (N, Hs, dh)``: what the attention call received for those tokens, rotary applied or not, with
    ``Hs = H`` (keys expanded before the call) or ``Hs`` dividing ``H`` (``enable_gqa``: query head ``h``
    meets ``k_seen`` head ``h // (H / Hs)``). ``q_post``/``k_post``: the module's own transform after the
    projection (QK-norm), applied to the probe's ``(N, H, dh)`` view before comparing.

    Three per-head least-squares fits, each invariant to rotary embeddings (a rotation keeps norms and the
    diagonal logit), to a constant scale and to a projection bias ``b``:

    * ``|q_i|^2 = s^2 |p_i|^2 + 2 s^2 b . p_i + s^2 |b|^2`` with ``p_i`` the probe's ``x_i . W_q[h]``;
    * the same for the key each query head meets, under each pairing;
    * ``q_i . k_i = s (p_i . r_i) + b_q . r_i + b_k . p_i + c`` with ``r_i`` the probe's key under the pairing.

    A fit holds when its worst residual is within ``tol`` of the target's largest value; a pairing fits when
    all three hold. ``tol`` defaults to the least precise input's (:data:`TOLERANCES`: measured on Llama,
    right readings left residuals of 6e-7 in float32 and 1.2e-2 in bfloat16, wrong ones 0.59 and more).
    More than ``2 dh + 2`` tokens are needed, else ``unverified``; at most ``max_tokens`` are used (evenly
    strided), which bounds the cost at ``H x max_tokens x (2 dh + 2)`` float64 numbers.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x, wq, wk = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((64, 8), (4, 2, 8), (2, 2, 8)))
        >>> q, k = torch.einsum("nd,hed->nhe", x, wq), torch.einsum("nd,hed->nhe", x, wk)
        >>> check_layout(x, wq, wk, q, k[:, [0, 1, 0, 1]]).verdict  # keys tiled by the forward
        'tiled'
    """
    if tol is None:
        tol = max(TOLERANCES.get(t.dtype, TOLERANCES[torch.float16]) for t in (x, query, key, q_seen, k_seen))
    x = x.detach().reshape(-1, x.shape[-1])
    if max_tokens is not None and x.shape[0] > max_tokens:
        keep = torch.linspace(0, x.shape[0] - 1, max_tokens, device=x.device).long()
        x, q_seen, k_seen = x[keep], q_seen[keep], k_seen[keep]
    x = x.double()
    query, key = query.detach().double(), key.detach().double()
    q_seen, k_seen = q_seen.detach().double(), k_seen.detach().double()
    (num_heads, head_dim, _), num_kv = query.shape, key.shape[0]
    if (
        q_seen.shape[1:] != (num_heads, head_dim)
        or k_seen.shape[-1] != head_dim
        or num_heads % k_seen.shape[1]
    ):
        return LayoutCheck(
            "mismatch",
            (),
            None,
            f"the attention call received q {tuple(q_seen.shape[1:])} and k "
            f"{tuple(k_seen.shape[1:])} (heads, head_dim); the probe read {num_heads} query and "
            f"{num_kv} key heads of {head_dim}",
            {},
        )
    if x.shape[0] <= 2 * head_dim + 2:
        return LayoutCheck(
            "unverified", (), None, f"{x.shape[0]} tokens: the check needs more than {2 * head_dim + 2}", {}
        )
    with torch.no_grad():
        qp = torch.einsum("nd,hed->nhe", x, query)
        kp = torch.einsum("nd,hed->nhe", x, key)
        if q_post is not None:
            qp = q_post(qp).double()
        if k_post is not None:
            kp = k_post(kp).double()
        seen_k = k_seen[:, key_heads("grouped", num_heads, k_seen.shape[1])]  # what query head h met
        diag_seen = (q_seen * seen_k).sum(-1)
        ones = torch.ones_like(diag_seen)
        # each test passes by the direct comparison (no bias, no factor) or by the fit (few distinct
        # tokens, padding rows of zeros, can leave the fit's least squares too ill-conditioned to be exact)
        # the fits have 2 dh + 2 unknowns per head: they count only where more distinct tokens than that
        # were read (a shared prompt repeats its rows); the direct comparisons count however few
        distinct = torch.unique(x, dim=0).shape[0]
        fit = _fit if distinct > 2 * head_dim + 2 else (lambda target, features: (math.inf, None))
        q_norms = qp.square().sum(-1)
        residuals = {"q": min(_direct(q_seen.square().sum(-1), q_norms),
                              fit(q_seen.square().sum(-1), [q_norms, qp, ones])[0])}
        fits, scales = [], {}
        for pairing in PAIRINGS:
            r = kp[:, key_heads(pairing, num_heads, num_kv)]
            k_norms, logits = r.square().sum(-1), (qp * r).sum(-1)
            residuals[f"k {pairing}"] = min(_direct(seen_k.square().sum(-1), k_norms),
                                            fit(seen_k.square().sum(-1), [k_norms, r, ones])[0])
            direct = _direct(diag_seen, logits)
            fitted, coef = fit(diag_seen, [logits, r, qp, ones])
            residuals[f"q.k {pairing}"] = min(direct, fitted)
            if max(residuals["q"], residuals[f"k {pairing}"], residuals[f"q.k {pairing}"]) <= tol:
                fits.append(pairing)
                scales[pairing] = 1.0 if direct <= tol else float(coef[:, 0].median())
    fits_t = tuple(fits)
    post = " with the module's q/k transform applied (outside W_qk by definition)" if q_post or k_post else ""
    if "grouped" in fits_t:
        scale = scales["grouped"]
        factor = "" if abs(scale - 1) <= tol else f"; q.k carries a constant factor {scale:.6g}"
        return LayoutCheck(
            "ok", fits_t, scale, f"reading verified{post} (pairing {'/'.join(fits_t)}){factor}", residuals
        )
    if fits_t == ("tiled",):
        return LayoutCheck(
            "tiled",
            fits_t,
            scales["tiled"],
            "the forward tiles the key heads (query head h meets "
            "key head h % Hkv), not h // (H/Hkv): read with the keys tiled",
            residuals,
        )
    if distinct <= 2 * head_dim + 2:
        return LayoutCheck(
            "unverified", (), None, f"{distinct} distinct tokens: the forward's q/k differ from the probe's "
            f"by more than a direct comparison allows, and fitting a bias or a factor needs more than {2 * head_dim + 2}",
            residuals,
        )
    what = [f"{name} (residual {value:.3g})" for name, value in residuals.items() if value > tol]
    return LayoutCheck(
        "mismatch",
        (),
        None,
        f"the probe's x.W_q/x.W_k{post} do not reproduce the forward's: " + ", ".join(what),
        residuals,
    )


__all__ = ["PAIRINGS", "TOLERANCES", "LayoutCheck", "check_layout", "key_heads"]
