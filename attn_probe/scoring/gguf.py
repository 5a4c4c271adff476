"""Score a GGUF file (llama.cpp's format) one layer at a time, without transformers.

A GGUF file has no ``config.json``: the architecture and the attention layout come from its
metadata (``general.architecture``, ``{arch}.block_count``, ``{arch}.embedding_length``,
``{arch}.attention.head_count``/``head_count_kv``/``key_length``). The query and key weights
of each block (``blk.{i}.attn_q.weight``, ``blk.{i}.attn_k.weight``) are read with the
``gguf`` package (optional extra: ``pip install 'attn-probe[gguf]'``) from the memory-mapped
file and dequantized (``gguf.quants.dequantize``) only when a layer is scored, so about one
layer's ``W_q`` and ``W_k`` in float32 are in memory at a time.

Row order within a head. llama.cpp's converter reorders the rows of ``W_q`` and ``W_k``
within every head for the ``llama`` architecture (from Hugging Face's half-split rotary layout
to interleaved pairs). A permutation ``P`` of the rows of one head, applied to both the query
and the key head, leaves ``Q_h^T K_h = (P Q_h)^T (P K_h)`` unchanged, so the layer and the
per-head scores do not depend on it as long as query and key are treated alike. For the
``llama`` architecture the permutation is undone anyway (:func:`unpermute_rows`), so that
the factors equal those of the Hugging Face model; other architectures are stored unpermuted.

Per-head q/k normalisation (Qwen3, Gemma 3, OLMo 2) is not part of ``W_q W_k^T`` and is
ignored here, as it is for Hugging Face models.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..extraction.base import AttentionLayer, ParamGetter

__all__ = [
    "GGUFError",
    "GGUFInfo",
    "GGUFWeights",
    "SUPPORTED_ARCHITECTURES",
    "is_gguf_file",
    "open_gguf",
    "score_gguf",
    "unpermute_rows",
]

GGUF_MAGIC = b"GGUF"
GROUP = "self"

#: GGUF architectures with separate ``attn_q``/``attn_k`` tensors and the usual head split,
#: mapped to whether llama.cpp's converter permuted their q/k rows within each head.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "llama": True,  # Llama, Mistral, Mixtral, SmolLM/SmolLM2, ... are all written as "llama"
    "qwen2": False,
    "qwen2moe": False,
    "qwen3": False,
    "qwen3moe": False,
    "gemma": False,
    "gemma2": False,
    "gemma3": False,
    "olmo": False,
    "olmo2": False,
    "starcoder2": False,
}

_INSTALL_HINT = "reading GGUF files needs the 'gguf' package: pip install 'attn-probe[gguf]'"


class GGUFError(ValueError):
    """The GGUF file cannot be scored (unreadable, unsupported architecture or tensor type)."""


@dataclass(frozen=True)
class GGUFInfo:
    """What the metadata of a GGUF file says about its attention layers."""

    path: str
    architecture: str
    name: str | None
    num_layers: int
    hidden_size: int
    #: per layer (GGUF allows per-layer head counts)
    num_heads: tuple[int, ...]
    num_kv_heads: tuple[int, ...]
    head_dim: int
    #: the GGML type names of the scored q/k tensors, e.g. ``("Q4_1",)``
    tensor_types: tuple[str, ...]
    #: whether the q/k rows are reordered back from llama.cpp's within-head permutation
    unpermuted: bool


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return gguf


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's within-head row order of a ``(num_heads * head_dim, d)`` q or k weight.

    llama.cpp's converter writes ``w.reshape(n, 2, dh // 2, d).swapaxes(1, 2)``; this is
    its inverse. The same permutation is applied to every head, query and key alike.
    """
    rows, d = weight.shape
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise GGUFError(f"cannot unpermute a {tuple(weight.shape)} weight with {num_heads} heads")
    return weight.reshape(num_heads, head_dim // 2, 2, d).transpose(1, 2).reshape(rows, d)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception as exc:  # noqa: BLE001 - a malformed field: report it by name
        raise GGUFError(f"metadata field {key!r} is unreadable ({type(exc).__name__}: {exc})") from None


def _per_layer(value: Any, key: str, num_layers: int) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) != num_layers:
            raise GGUFError(f"metadata {key!r} has {len(value)} entries for {num_layers} layers")
        out = tuple(int(v) for v in value)
    else:
        out = (int(value),) * num_layers
    return out


class GGUFWeights:
    """Lazy access to the tensors of a GGUF file; calling it with a tensor name dequantizes it.

    ``weights(name)`` returns a fresh float32 ``(rows, cols)`` tensor in ``nn.Linear``
    convention (``out_features x in_features``), with llama.cpp's q/k row permutation undone
    for ``blk.N.attn_q.weight``/``blk.N.attn_k.weight`` where the architecture has it, so an
    instance is a :data:`~attn_probe.extraction.base.ParamGetter`. Nothing is cached.
    """

    def __init__(self, path: str | Path) -> None:
        gguf = _gguf()
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise GGUFError(f"{self.path}: no such file")
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: not a file")
        if not is_gguf_file(self.path):
            raise GGUFError(f"{self.path}: not a GGUF file (no 'GGUF' magic at the start)")
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # noqa: BLE001 - truncated or corrupt files
            raise GGUFError(f"{self.path}: unreadable GGUF file ({type(exc).__name__}: {exc})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.info = self._read_info()

    # ------------------------------------------------------------------ metadata
    def _read_info(self) -> GGUFInfo:
        arch = _field(self._reader, "general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture in the metadata")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: architecture {arch!r} is not supported for GGUF scoring "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}); convert the model to a "
                "Hugging Face checkpoint and use score_checkpoint instead"
            )

        def required(key: str) -> Any:
            value = _field(self._reader, f"{arch}.{key}")
            if value is None:
                raise GGUFError(f"{self.path}: metadata has no {arch}.{key}")
            return value

        num_layers = self._checked_block_count(arch, required("block_count"))
        hidden = int(required("embedding_length"))
        heads = _per_layer(required("attention.head_count"), f"{arch}.attention.head_count", num_layers)
        kv_raw = _field(self._reader, f"{arch}.attention.head_count_kv")
        kv = heads if kv_raw is None else _per_layer(kv_raw, f"{arch}.attention.head_count_kv", num_layers)
        key_length = _field(self._reader, f"{arch}.attention.key_length")
        if key_length is not None:
            head_dim = int(key_length)
        elif heads[0] and hidden % heads[0] == 0:
            head_dim = hidden // heads[0]
        else:
            raise GGUFError(f"{self.path}: cannot infer the head size ({hidden} / {heads[0]} heads)")
        for i, (h, g) in enumerate(zip(heads, kv, strict=True)):
            if h <= 0 or g <= 0 or h % g:
                raise GGUFError(f"{self.path}: layer {i} has {h} query heads and {g} key/value heads")
        types = set()
        for i in range(num_layers):
            for kind in ("q", "k"):
                types.add(self._tensor(_tensor_name(i, kind)).tensor_type)
        self._check_types(types)
        name = _field(self._reader, "general.name")
        return GGUFInfo(
            path=str(self.path), architecture=arch, name=name if isinstance(name, str) else None,
            num_layers=num_layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
            head_dim=head_dim, tensor_types=tuple(sorted(t.name for t in types)),
            unpermuted=SUPPORTED_ARCHITECTURES[arch],
        )

    def _checked_block_count(self, arch: str, value: Any) -> int:
        """``{arch}.block_count`` checked against the blocks whose tensors the file holds, before
        anything per layer is built: a hostile count (``2**32 - 1``) is an error, not an allocation."""
        try:
            count = int(value)
        except (TypeError, ValueError, OverflowError):
            raise GGUFError(f"{self.path}: {arch}.block_count is not a number ({value!r})") from None
        blocks = {int(p[1]) for p in (n.split(".", 2) for n in self._tensors)
                  if len(p) == 3 and p[0] == "blk" and p[1].isdigit() and len(p[1]) <= 9}
        if count <= 0 or count > len(blocks):
            raise GGUFError(f"{self.path}: the metadata says {arch}.block_count = {count}, but the file holds "
                            f"tensors of {len(blocks)} block{'s' if len(blocks) != 1 else ''} (blk.N.*); "
                            "the file is corrupt or was not written by llama.cpp's converter")
        return count

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            fused = name.replace("attn_q", "attn_qkv").replace("attn_k", "attn_qkv")
            hint = " (the file has a fused attn_qkv tensor, which is not supported)" if fused in self._tensors else ""
            raise GGUFError(f"{self.path}: tensor {name!r} is not in the file{hint}")
        return tensor

    def _check_types(self, types: Iterable[Any]) -> None:
        bad = sorted(t.name for t in types if not _can_dequantize(t))
        if bad:
            raise GGUFError(
                f"{self.path}: cannot dequantize tensor type(s) {', '.join(bad)} with the installed gguf "
                "package (upgrading it may add them)"
            )

    # ------------------------------------------------------------------ tensors
    def keys(self) -> set[str]:
        """Every tensor name in the file."""
        return set(self._tensors)

    def __call__(self, name: str) -> torch.Tensor:
        import numpy as np

        tensor = self._tensor(name)
        self._check_types([tensor.tensor_type])
        shape = [int(n) for n in tensor.shape]  # ggml order: fastest-varying dimension first
        if len(shape) != 2:
            raise GGUFError(f"{self.path}: tensor {name!r} has shape {shape}, expected a matrix")
        cols, rows = shape
        try:
            arr = _dequantize(tensor)
            weight = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(rows, cols))
        except GGUFError:
            raise
        except Exception as exc:  # noqa: BLE001 - corrupt data, a bug in a dequantizer
            raise GGUFError(
                f"{self.path}: cannot dequantize {name!r} ({tensor.tensor_type.name}): {type(exc).__name__}: {exc}"
            ) from None
        layer, kind = _parse_qk_name(name)
        if kind is not None and self.info.unpermuted and layer < self.info.num_layers:
            heads = self.info.num_heads[layer] if kind == "q" else self.info.num_kv_heads[layer]
            weight = unpermute_rows(weight, heads)
        return weight


def _tensor_name(layer: int, kind: str) -> str:
    return f"blk.{layer}.attn_{kind}.weight"


def _parse_qk_name(name: str) -> tuple[int, str | None]:
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in ("attn_q", "attn_k"):
        return int(parts[1]), parts[2][-1]
    return -1, None


def _can_dequantize(qtype: Any) -> bool:
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    if qtype in (T.F32, T.F16, T.F64):
        return True
    traits = getattr(gguf.quants, "_type_traits", None)
    if traits is None:  # a future gguf without the registry: try, and report at read time
        return True
    return qtype in traits


def _dequantize(tensor: Any) -> Any:
    import numpy as np

    gguf = _gguf()
    if tensor.tensor_type == gguf.GGMLQuantizationType.F64:
        return np.asarray(tensor.data).view(np.float64)
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFError(f"tensor type {tensor.tensor_type.name} cannot be dequantized: {exc}") from None


# --------------------------------------------------------------------------- API
def open_gguf(
    path: str | Path,
    *,
    layers: Iterable[int] | None = None,
) -> tuple[list[AttentionLayer], GGUFWeights]:
    """The attention layers of a GGUF file, and a getter that dequantizes one tensor on demand.

    Returns ``(layers, weights)``: one :class:`~attn_probe.extraction.AttentionLayer` per block
    (group ``"self"``, named ``blk.N.attn``, ``param_names`` the GGUF tensor names) and a
    :class:`GGUFWeights`, a ``name -> tensor`` getter, so ``layer.factors(weights)`` gives
    per-head ``W_q (H, dh, d)`` and ``W_k (Hkv, dh, d)`` in float32 and ``layer.qk_matrix(weights)``
    the explicit matrix. ``weights.info`` is the :class:`GGUFInfo`. ``layers`` keeps only those
    layer indices. Raises :class:`GGUFError` for unreadable files, unsupported architectures
    or tensor types, and ``ImportError`` when the ``gguf`` package is missing.

    Example:
        >>> found, weights = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
        >>> query, key = found[0].factors(weights)  # doctest: +SKIP
    """
    weights = GGUFWeights(path)
    info = weights.info
    wanted = None if layers is None else {int(i) for i in layers}
    if wanted is not None:
        outside = sorted(i for i in wanted if not 0 <= i < info.num_layers)
        if outside:
            raise GGUFError(f"{weights.path}: layer(s) {outside} out of range (the file has {info.num_layers})")
    found = []
    for i in range(info.num_layers):
        if wanted is not None and i not in wanted:
            continue
        q_name, k_name = _tensor_name(i, "q"), _tensor_name(i, "k")
        heads, kv = info.num_heads[i], info.num_kv_heads[i]
        found.append(AttentionLayer(
            name=f"blk.{i}.attn", group=GROUP, layer=i, num_heads=heads, num_kv_heads=kv,
            head_dim=info.head_dim, hidden_size=info.hidden_size, param_names=(q_name, k_name),
            split=_splitter(q_name, k_name, heads, kv, info.head_dim, info.hidden_size),
        ))
    return found, weights


def _splitter(q_name: str, k_name: str, heads: int, kv: int, head_dim: int, hidden: int) -> Any:
    def split(get: ParamGetter) -> tuple[torch.Tensor, torch.Tensor]:
        query, key = get(q_name), get(k_name)
        if tuple(query.shape) != (heads * head_dim, hidden) or tuple(key.shape) != (kv * head_dim, hidden):
            raise GGUFError(
                f"{q_name} {tuple(query.shape)} / {k_name} {tuple(key.shape)} do not match the metadata "
                f"({heads} and {kv} heads of size {head_dim}, hidden size {hidden})"
            )
        return query.reshape(heads, head_dim, hidden), key.reshape(kv, head_dim, hidden)

    return split


def score_gguf(
    path: str | Path,
    per_head: bool = False,
    *,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
    layers: Iterable[int] | None = None,
    progress: bool | None = None,
    metrics: Iterable[str] | None = None,
) -> list[dict[str, Any]]:
    """The metrics of every attention layer of a GGUF file: rows as :func:`attn_probe.score_checkpoint`.

    One layer is dequantized at a time. ``progress`` shows a tqdm bar on stderr (default: when
    stderr is a terminal). Raises :class:`GGUFError` for unusable input.
    """
    from ..core import check_metrics
    from .model import score_layer

    num_std = float(num_std)
    if not math.isfinite(num_std):
        raise GGUFError(f"num_std must be finite, got {num_std}")
    try:
        names = check_metrics(tuple(metrics) if metrics is not None else None)
    except ValueError as exc:
        raise GGUFError(str(exc)) from None
    found, weights = open_gguf(path, layers=layers)
    items: Iterable[AttentionLayer] = found
    if sys.stderr.isatty() if progress is None else progress:
        from tqdm.auto import tqdm

        items = tqdm(found, desc="scoring layers", unit="layer", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for layer in items:
            query, key = layer.factors(weights)
            rows += score_layer(layer, query, key, per_head=per_head, num_std=num_std, dtype=dtype,
                                metrics=names)
            del query, key
    return rows
