"""W_qk heatmap images: one more scheduled quantity of the probe (numpy and torch only)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..extraction import AttentionLayer
from .schedules import Schedule

__all__ = ["render_heatmap", "qk_image", "HeatmapImages"]

Tensor = torch.Tensor


def render_heatmap(matrix: np.ndarray) -> np.ndarray:
    """``HxWx3`` uint8 image of a matrix with a symmetric colour scale: blue < 0 < red, white at 0."""
    m = np.asarray(matrix, dtype=np.float64)
    m = np.where(np.isfinite(m), m, 0.0)
    vmax = float(np.abs(m).max()) if m.size else 0.0
    x = m / vmax if vmax > 0 else np.zeros_like(m)
    pos, neg = np.clip(x, 0, 1), np.clip(-x, 0, 1)
    rgb = np.stack([1 - neg, 1 - pos - neg, 1 - pos], axis=-1)
    return np.round(rgb * 255).astype(np.uint8)


def qk_image(query: Tensor, key: Tensor, size: int, mode: str) -> np.ndarray:
    """Heatmap of the layer's ``W_qk``: average-pooled to ``size`` (``downsample``) or its top-left block."""
    num_heads, head_dim, d = query.shape
    num_kv = key.shape[0]
    q = query.detach().float().reshape(num_kv, num_heads // num_kv, head_dim, d).sum(1)
    if mode == "block":
        m = q.reshape(-1, d)[:, :size].T @ key.detach().float().reshape(-1, d)[:, :size]
    else:
        m = q.reshape(-1, d).T @ key.detach().float().reshape(-1, d)
        if d > size:
            m = torch.nn.functional.adaptive_avg_pool2d(m[None, None], size)[0, 0]
    return render_heatmap(m.cpu().numpy())


class HeatmapImages:
    """Scheduled heatmaps of every layer's W_qk, written to ``Snapshot.images`` (main process)."""

    def __init__(self, schedule: Schedule, size: int = 128, mode: str = "downsample") -> None:
        self.schedule = schedule
        self.size = size
        self.mode = mode

    def due(self, step: int) -> bool:
        return bool(self.schedule(step))

    def measure(self, layer: AttentionLayer, get: Callable[[str], Tensor]) -> np.ndarray:
        query, key = layer.factors(get)
        return qk_image(query, key, self.size, self.mode)
