"""Find every attention layer of a model and expose its q/k weights as per-head views."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import nn

from . import architectures, recipes
from .architectures import FUSED_LAYOUTS, USER_ADAPTERS, QKLayout, group_of, recognise, unwrap
from .base import GROUPS, AttentionLayer, UnsupportedModelError

Adapter = Callable[[nn.Module, str, Any], "QKLayout | None"]

__all__ = [
    "AttentionLayer",
    "UnsupportedModelError",
    "QKLayout",
    "find_attention",
    "register_adapter",
    "unregister_adapter",
    "FUSED_LAYOUTS",
    "unwrap",
    "GROUPS",
    "entry_point",
]


def register_adapter(adapter: Adapter) -> Adapter:
    """Teach attn_probe a new layout: ``adapter(module, path, config) -> QKLayout | None``.

    ``path`` is the module's name in the unwrapped model; the returned layout names the
    parameters it reads (``param_names``) and its ``split(get)`` must read them only through
    ``get``. Registered adapters are tried before the built-in ones, newest first. Usable as
    a decorator; undo with :func:`unregister_adapter`.
    """
    USER_ADAPTERS.insert(0, adapter)
    return adapter


def unregister_adapter(adapter: Adapter) -> None:
    """Remove an adapter added with :func:`register_adapter` (no error if absent)."""
    while adapter in USER_ADAPTERS:
        USER_ADAPTERS.remove(adapter)


def _linear_children(module: nn.Module) -> list[str]:
    return [n for n, c in module.named_children() if architectures.projection(c, n) is not None]


def _fused_width(module: nn.Module, name: str) -> str | None:
    """``"32 -> 96 = 3 x 32"`` when child ``name`` is a projection whose output could hold q, k and v
    for its input width ``d``: ``3 d``, or ``d + 2 kv`` with ``kv`` a proper divisor of ``d`` (GQA)."""
    proj = architectures.projection(getattr(module, name), name)
    if proj is None:
        return None
    d, out = proj.in_features, proj.out_features
    if out == 3 * d:
        return f"{d} -> {out} = 3 x {d}"
    kv, odd = divmod(out - d, 2)
    if not odd and 0 < kv < d and d % kv == 0:
        return f"{d} -> {out} = {d} + 2 x {kv}"
    return None


def _model_width(model: nn.Module) -> int | None:
    """The model's width: its config's ``hidden_size``, else the most common projection input size."""
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(width, int) and width > 0:
        return width
    sizes: dict[int, int] = {}
    for name, module in model.named_modules():
        proj = architectures.projection(module, name.rsplit(".", 1)[-1])
        if proj is not None:
            sizes[proj.in_features] = sizes.get(proj.in_features, 0) + 1
    return max(sizes, key=lambda k: sizes[k]) if sizes else None


def _width_children(module: nn.Module, width: int | None) -> list[str]:
    """Children of ``module`` that project the model's width (``in_features == width``), at most
    as wide again (a query, key or value; an MLP's up projection is wider)."""
    out = []
    for name in _linear_children(module):
        proj = architectures.projection(getattr(module, name), name)
        if proj is not None and proj.in_features == width and proj.out_features <= width:
            out.append(name)
    return out


def _qk_guess(kids: list[str]) -> tuple[str, str] | None:
    qs = [n for n in kids if "q" in n.lower() and "k" not in n.lower()]
    ks = [n for n in kids if "k" in n.lower() and "q" not in n.lower()]
    return (qs[0], ks[0]) if qs and ks else None


def _candidates(
    model: nn.Module, limit: int = 6
) -> tuple[list[str], tuple[str, str] | None, str | None, tuple[str, str | None] | None]:
    """Candidate attention modules, a guessed ``(query, key)`` child pair, a description of a
    child that looks like a fused q/k/v projection (by name or by width), and a layout no rule
    reads with the ``register_adapter`` call that reads it (:mod:`.recipes`; the call is ``None``
    where the module states no head count).

    A candidate is a module named like attention with projection children, or, whatever its
    class name, one holding two or more projections of the model's width (a query, a key...), a
    child named like a fused q/k/v projection, or per-head ``W_Q``/``W_K`` parameters.
    The guess: q/k-lettered names, else the first two such projections in definition order."""
    width = _model_width(model)
    seen: list[tuple[int, str]] = []
    guess: tuple[str, str] | None = None
    by_shape: tuple[str, str] | None = None
    fused: str | None = None
    recipe: tuple[str, str | None] | None = None
    for path, module in model.named_modules():
        low = (path.rsplit(".", 1)[-1] + type(module).__name__).lower()
        kids = _linear_children(module)
        named = "attn" in low or "attention" in low
        shaped = _width_children(module, width) if width is not None else []
        readable = recipes.fused_qkv_recipe(module, path) or recipes.per_head_params_recipe(module, path)
        if readable is None and (not kids or not named and len(shaped) < 2):
            continue
        if recipe is None:
            recipe = readable
        if not kids:  # per-head parameters, no projection child
            params = [f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=False)]
            seen.append((0, f"{path or '<root>'} ({type(module).__name__}: parameters {', '.join(params[:6])})"))
            continue
        if guess is None:
            guess = _qk_guess(kids) or (_qk_guess(shaped) if not named else None)
        if by_shape is None and len(shaped) >= 2:
            by_shape = (shaped[0], shaped[1])
        if fused is None:
            prefix = f"{path}." if path else ""
            widths = [(n, _fused_width(module, n)) for n in kids]
            fused = next((f"'{n}' looks like a fused q/k/v projection ({prefix}{n}: {w})" for n, w in widths if w),
                         None)
            if fused is None:
                fused = next((f"'{n}' looks like a fused q/k/v projection ({prefix}{n})"
                              for n in kids if "q" in n.lower() and "k" in n.lower()), None)
        what = ", ".join(kids) if named or readable or len(shaped) == len(kids) else \
            f"{', '.join(shaped)} of the model's width {width}; also {', '.join(k for k in kids if k not in shaped)}"
        seen.append((0 if named or readable else 1, f"{path or '<root>'} ({type(module).__name__}: {what})"))
    seen.sort(key=lambda item: item[0])  # named like attention (or readable by a recipe) first, then by shape
    if guess is None and fused is None and recipe is None:
        guess = by_shape
    return [text for _, text in seen[:limit]], guess, fused, recipe


def _unread_projections(root: nn.Module, pairs: list[tuple[str, str]]) -> str | None:
    """``"layers.0.attn.q_proj (Conv1d)"``: the first child named in ``pairs`` that is not a projection
    attn_probe reads, else ``None`` (then the head counts are what failed)."""
    for path, module in root.named_modules():
        children = dict(module.named_children())
        for pair in pairs:
            if not all(n in children for n in pair):
                continue
            for n in pair:
                if architectures.projection(children[n], n) is None:
                    return f"{path + '.' if path else ''}{n} ({type(children[n]).__name__})"
    return None


#: how the user's call takes ``qk_names``, by the public entry point that marked itself (:func:`entry_point`)
#: (function or class name -> call form; ``{}`` is the pairs)
_CALL_FORMS = {
    "watch": 'attn_probe.watch(model, ..., find_kwargs={{"qk_names": {}}})',
    "attach": 'attn_probe.attach(trainer, ..., find_kwargs={{"qk_names": {}}})',
    "AttnProbeCallback": 'AttnProbeCallback(..., find_kwargs={{"qk_names": {}}})',
    "Probe": 'attn_probe.Probe(model, ..., find_kwargs={{"qk_names": {}}})',
    "score_model": "attn_probe.score_model(model, qk_names={})",
    "find_attention": "attn_probe.find_attention(model, qk_names={})",
}


#: the public call the user made (a key of :data:`_CALL_FORMS`), set by that call (:func:`entry_point`)
_ENTRY: ContextVar[str | None] = ContextVar("attn_probe_entry_point", default=None)


@contextmanager
def entry_point(name: str) -> Iterator[None]:
    """Mark the public call ``name`` (``"watch"``, ``"attach"``, ``"AttnProbeCallback"``, ``"Probe"``,
    ``"score_model"``) around its work, as a ``with`` block or a decorator: an unsupported model's
    message then shows the fix in that call's form. The outermost mark wins (``watch`` builds a
    ``Probe``: the user called ``watch``)."""
    token = _ENTRY.set(name) if _ENTRY.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _ENTRY.reset(token)


def _entry_point() -> str:
    """The public attn_probe call the user made (:func:`entry_point`; none marked: ``find_attention``)."""
    return _ENTRY.get() or "find_attention"


def call_form(entry: str, pairs: str) -> str:
    """How ``entry`` (``"watch"``, ``"attach"``, ``"AttnProbeCallback"``, ...) takes ``qk_names=pairs``."""
    return _CALL_FORMS.get(entry, _CALL_FORMS["find_attention"]).format(pairs)


#: model types without softmax attention (no query-key product): state-space and recurrent models
_NO_SOFTMAX_ATTENTION = {
    "mamba": "a state-space model: its layers mix tokens with a selective scan",
    "mamba2": "a state-space model: its layers mix tokens with a selective scan",
    "falcon_mamba": "a state-space model: its layers mix tokens with a selective scan",
    "rwkv": "a recurrent model: its time-mixing layers use a decaying linear recurrence",
    "xlstm": "a recurrent model: its layers are mLSTM/sLSTM cells",
}
#: model types whose attention layout docs/supported-models.md lists as not supported
_UNSUPPORTED_LAYOUTS = {
    "squeezebert": "its query and key projections are grouped nn.Conv1d layers (SqueezeBERT)",
    "reformer": "its LSH attention uses one shared query-key projection (Reformer)",
}
#: the same, recognised by module class when the model has no config
_CLASS_HINTS = {"MambaMixer": "mamba", "Mamba2Mixer": "mamba2", "FalconMambaMixer": "falcon_mamba",
                "RwkvSelfAttention": "rwkv", "SqueezeBertSelfAttention": "squeezebert",
                "LSHSelfAttention": "reformer"}


def _known_unsupported(model: nn.Module, cfg: Any) -> str | None:
    """Why a model attn_probe knows it cannot read has no W_qk for it, or ``None``."""
    kind = str(getattr(cfg, "model_type", "") or "")
    if kind not in _NO_SOFTMAX_ATTENTION and kind not in _UNSUPPORTED_LAYOUTS:
        kind = next((_CLASS_HINTS[type(m).__name__] for m in model.modules() if type(m).__name__ in _CLASS_HINTS), "")
    name = f"{type(model).__name__} (model type {kind!r})"
    if kind in _NO_SOFTMAX_ATTENTION:
        return (f"attn_probe cannot score {name}: it has no softmax attention ({_NO_SOFTMAX_ATTENTION[kind]}, "
                "not query-key dot products), so there is no W_qk = W_q W_k^T to measure.")
    if kind in _UNSUPPORTED_LAYOUTS:
        return (f"attn_probe cannot score {name}: {_UNSUPPORTED_LAYOUTS[kind]}, a layout listed as not "
                "supported in docs/supported-models.md.")
    return None


def _torch_transformer_groups(root: nn.Module) -> dict[int, str]:
    """Groups of the attention modules inside torch's own ``nn.TransformerDecoderLayer`` and
    ``nn.TransformerEncoderLayer`` (``nn.Transformer``, and models built from those layers), by
    module id: a decoder layer's ``multihead_attn`` attends to the encoder's output (``memory``),
    so it is ``cross``; with both kinds of layer in the model, it is an encoder-decoder model: the
    encoder layers' ``self_attn`` is ``encoder``, the decoder layers' ``decoder``. These classes
    carry no config and their names no cross-attention marker, so the path rules cannot tell."""
    encoders = [m for m in root.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    decoders = [m for m in root.modules() if isinstance(m, nn.TransformerDecoderLayer)]
    groups: dict[int, str] = {}
    for layer in decoders:
        groups[id(layer.multihead_attn)] = "cross"
        if encoders:
            groups[id(layer.self_attn)] = "decoder"
    if decoders:
        for layer in encoders:
            groups[id(layer.self_attn)] = "encoder"
    return groups


def _latent_attention(model: nn.Module) -> str | None:
    """The path of a multi-head latent attention module (low-rank keys), if ``model`` has one."""
    for path, module in model.named_modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
            return path or "<root>"
    return None


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

    ``model`` may be wrapped (DDP/DeepSpeed ``.module``, ``torch.compile``, PEFT); names
    are relative to the unwrapped model. ``group`` is ``"self"`` for single-stack models and
    ``"encoder"``/``"decoder"``/``"cross"`` for encoder-decoder ones (``nn.Transformer`` included;
    cross-attention is also recognised by name elsewhere, and as the ``multihead_attn`` of an
    ``nn.TransformerDecoderLayer``); ``layer`` counts within the group. Each record's
    ``factors()`` gives per-head ``W_q (H, dh, d)`` and ``W_k (Hkv, dh, d)``; query head
    ``h`` pairs with KV head ``h // (H / Hkv)`` as in transformers' ``repeat_kv``.

    ``qk_names`` adds child-name pairs such as ``[("my_q", "my_k")]`` for custom models;
    ``adapter`` is tried first on every module (see :func:`register_adapter`).
    ``groups``/``layers`` filter the result. Raises :class:`UnsupportedModelError`, naming
    the model class, candidate modules and a call that fixes it, when nothing is recognised.
    Supported layouts: ``attn-probe models`` (and ``docs/supported-models.md``).

    Example:
        >>> from transformers import LlamaConfig, LlamaModel
        >>> model = LlamaModel(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                                num_key_value_heads=2, intermediate_size=64, vocab_size=99))
        >>> [(a.group, a.layer, a.num_heads, a.num_kv_heads, a.head_dim) for a in find_attention(model)]
        [('self', 0, 4, 2, 8), ('self', 1, 4, 2, 8)]
    """
    root = unwrap(model)
    cfg = config if config is not None else getattr(root, "config", None)
    is_enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
    extra = list(qk_names or [])
    params = dict(root.named_parameters(remove_duplicate=False))
    found: list[AttentionLayer] = []
    counters: dict[str, int] = {}
    claimed: list[str] = []
    torch_groups = _torch_transformer_groups(root)
    for path, module in root.named_modules():
        if any(path.startswith(c + ".") for c in claimed):
            continue  # projections inside an attention module already read
        layout = adapter(module, path, cfg) if adapter is not None else None
        if layout is None and extra:
            layout = architectures.separate_layout(module, path, cfg, names=extra)
            if layout is not None:
                architectures.check_head_counts(module, path, layout)
        if layout is None:
            layout = recognise(module, path, cfg)
        if layout is None:
            continue
        claimed.append(path)
        group = torch_groups.get(id(module)) or group_of(path, is_enc_dec)
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
                root=root,
                attached_adapters=architectures.attached_adapters(module),
            )
        )
    if not found:
        reason = _known_unsupported(root, cfg)
        if reason is not None:
            raise UnsupportedModelError(reason)
        latent = _latent_attention(root)
        if latent is not None:
            raise UnsupportedModelError(
                f"attn_probe cannot read {type(root).__name__}: {latent} is multi-head latent attention "
                "(MLA: DeepSeek-V2/V3 and models built like them). Its keys are a low-rank product "
                "(kv_a_proj_with_mqa, then kv_b_proj) with a separate rotary part, not one key projection, "
                "so no qk_names pair describes it; attn_probe does not score MLA yet."
            )
        named = [path or "<root>" for path, m in root.named_modules()
                 if any(q in dict(m.named_children()) and k in dict(m.named_children()) for q, k in extra)]
        unread = _unread_projections(root, extra)
        if unread:
            raise UnsupportedModelError(
                f"attn_probe found the children named in qk_names in {type(root).__name__} but cannot read "
                f"them as projections: {unread}. It reads nn.Linear, transformers Conv1D, PEFT LoRA wrappers and "
                "torchtune LoRALinear/DoRALinear; describe another kind with attn_probe.register_adapter(fn) "
                "(`attn-probe models` prints the recipe)."
            )
        if named:
            raise UnsupportedModelError(
                f"attn_probe found the projections named in qk_names in {', '.join(named[:3])}"
                f"{', ...' if len(named) > 3 else ''} ({type(root).__name__}) "
                "but could not split them into heads: it reads the number of heads from an int attribute "
                "of the attention module (num_heads, num_attention_heads, n_head, heads, ...) or its head size "
                "(head_dim, dim_head, ...), then from the model config (num_attention_heads); none was "
                "found, or it does not divide the projections' output sizes. Set one on the module "
                "(e.g. module.num_heads = 8), or describe the layout with attn_probe.register_adapter(fn)."
            )
        cands, guess, fused, recipe = _candidates(root)
        if recipe is not None and recipe[1] is not None and guess is None:
            what, call = recipe
            rows = "" if "per-head" in what else "If its rows are [q | k | v], each block head-major, r"
            raise UnsupportedModelError(
                f"attn_probe found no attention layer it can read in {type(root).__name__}. "
                f"Candidate modules: {'; '.join(cands)}. {what}. {rows or 'R'}ead it by running this "
                f"after `import attn_probe` and before this call: `{call}` (other layouts: "
                "`attn-probe models` prints the adapter recipe)."
            )
        if recipe is not None and fused is None:
            fused = recipe[0]
        q_guess, k_guess = guess or ("my_q", "my_k")
        hint = (
            f" {fused}: describe its layout with "
            "attn_probe.register_adapter(fn)."
            if fused and guess is None
            else ""
        )
        raise UnsupportedModelError(
            f"attn_probe found no attention layer it can read in {type(root).__name__}. "
            f"Candidate modules: {'; '.join(cands) if cands else 'none'}.{hint} "
            "Name the query/key projection children, e.g. "
            f"{call_form(_entry_point(), repr([(q_guess, k_guess)]))}, "
            "or teach a fused layout with attn_probe.register_adapter(fn); "
            "run `attn-probe models` for the supported layouts and the adapter recipe."
        )
    if groups is not None:
        wanted = set(groups)
        found = [a for a in found if a.group in wanted]
    if layers is not None:
        wanted_layers = set(layers)
        found = [a for a in found if a.layer in wanted_layers]
    return found
