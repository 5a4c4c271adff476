"""Find every attention layer of a model and expose its q/k weights as per-head views."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn

from . import architectures
from .architectures import FUSED_LAYOUTS, QKLayout, group_of, recognise, unwrap
from .base import GROUPS, AttentionLayer, UnsupportedModelError

Adapter = Callable[[nn.Module, str, Any], "QKLayout | None"]

__all__ = [
    "AttentionLayer",
    "UnsupportedModelError",
    "QKLayout",
    "find_attention",
    "register_adapter",
    "unwrap",
    "GROUPS",
]


def register_adapter(adapter: Adapter) -> Adapter:
    """Teach attn_probe a new fused layout: ``adapter(module, path, config) -> QKLayout | None``.

    Registered adapters are tried before the built-in ones. Usable as a decorator.
    """
    FUSED_LAYOUTS.insert(0, adapter)
    return adapter


def _candidates(model: nn.Module, limit: int = 8) -> list[str]:
    seen = []
    for path, module in model.named_modules():
        low = (path.rsplit(".", 1)[-1] + type(module).__name__).lower()
        if "attn" in low or "attention" in low:
            kids = [n for n, c in module.named_children() if isinstance(c, nn.Linear) or hasattr(c, "weight")]
            seen.append(f"{path or '<root>'} ({type(module).__name__}: {', '.join(kids) or 'no linear children'})")
        if len(seen) >= limit:
            break
    return seen


def find_attention(
    model: nn.Module,
    *,
    qk_names: Iterable[tuple[str, str]] | None = None,
    adapter: Adapter | None = None,
    groups: Iterable[str] | None = None,
    layers: Iterable[int] | None = None,
    config: Any = None,
) -> list[AttentionLayer]:
    """One :class:`AttentionLayer` per attention module of ``model``, in module order.

    ``model`` may be wrapped (DDP ``.module``, ``torch.compile``, PEFT). ``qk_names`` adds
    child-name pairs such as ``[("my_q", "my_k")]`` for custom models; ``adapter`` is tried
    first on every module (see :func:`register_adapter`). ``groups``/``layers`` filter the
    result. Raises :class:`UnsupportedModelError` when nothing is recognised.
    """
    root = unwrap(model)
    cfg = config if config is not None else getattr(root, "config", None)
    is_enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
    extra = list(qk_names or [])
    params = dict(root.named_parameters(remove_duplicate=False))
    found: list[AttentionLayer] = []
    counters: dict[str, int] = {}
    claimed: list[str] = []
    for path, module in root.named_modules():
        if any(path.startswith(c + ".") for c in claimed):
            continue  # projections inside an attention module already read
        layout = adapter(module, path, cfg) if adapter is not None else None
        if layout is None and extra:
            layout = architectures.separate_layout(module, path, cfg, names=extra)
        if layout is None:
            layout = recognise(module, path, cfg)
        if layout is None:
            continue
        claimed.append(path)
        group = group_of(path, is_enc_dec)
        index = counters.get(group, 0)
        counters[group] = index + 1
        found.append(
            AttentionLayer(
                name=path,
                group=group,
                layer=index,
                num_heads=layout.num_heads,
                num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim,
                hidden_size=layout.hidden_size,
                param_names=layout.param_names,
                split=layout.split,
                module=module,
                params=params,
            )
        )
    if not found:
        cands = _candidates(root)
        raise UnsupportedModelError(
            f"attn_probe found no attention layer it can read in {type(root).__name__}. "
            f"Candidate modules: {'; '.join(cands) if cands else 'none'}. "
            "Name the query/key projections, e.g. "
            "attn_probe.find_attention(model, qk_names=[('my_q', 'my_k')]), "
            "or register a layout with attn_probe.register_adapter(fn)."
        )
    if groups is not None:
        wanted = set(groups)
        found = [a for a in found if a.group in wanted]
    if layers is not None:
        wanted_layers = set(layers)
        found = [a for a in found if a.layer in wanted_layers]
    return found
