"""Score a saved Hugging Face checkpoint directory without loading the model.

The model is built on the ``meta`` device (no memory, no initialisation) only to learn its
attention layout with :func:`attn_probe.find_attention`; then exactly the tensors the score
pairs declare (the query/key weights by default; with ``pairs=("qk", "ov")`` also the
value/output weights) of one layer at a time are read from ``model.safetensors`` (single or
sharded through ``model.safetensors.index.json``) or, for legacy checkpoints, from
``pytorch_model.bin`` (``torch.load(weights_only=True, mmap=True)``, never an unrestricted
pickle). Peak memory is about one layer's ``W_q`` and ``W_k`` (and ``W_v``, ``W_o``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..extraction import AttentionLayer, UnsupportedModelError, find_attention
from ..extraction.base import ParamGetter
from ..formats.tags import layer_stats
from ..sinks.assembly import snapshot_from_rows
from .model import (
    PairsLike,
    Row,
    check_model_pairs,
    pair_label,
    pairs_param_names,
    resolve_pairs,
    row_metrics,
    score_layer_pairs,
)
from .pairs import ScorePair, pair_metric_names

__all__ = [
    "CheckpointError",
    "score_checkpoint",
    "summarize_rows",
    "CheckpointWeights",
    "open_checkpoint",
    "find_checkpoints",
    "write_checkpoint_trajectory",
]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


class CheckpointError(ValueError):
    """The checkpoint cannot be scored (bad path, unreadable config or weights, no attention)."""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, without ANSI escape codes (torch's unpickling errors)."""
    text = _ANSI.sub("", str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# --------------------------------------------------------------------------- weights
class CheckpointWeights:
    """Lazy, read-only access to the tensors of a checkpoint directory, by saved key.

    Files are opened on first use; :meth:`get` reads one tensor (safetensors) or returns a
    memory-mapped one (``.bin``), so nothing but the requested tensors is brought into memory.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._handles: dict[str, Any] = {}
        if (directory / SAFE_INDEX).is_file():
            self.kind, self._map = "safetensors", self._read_index(directory / SAFE_INDEX)
        elif (directory / SAFE_SINGLE).is_file():
            self.kind, self._map = "safetensors", self._keys_of_safetensors(SAFE_SINGLE)
        elif (directory / BIN_INDEX).is_file():
            self.kind, self._map = "bin", self._read_index(directory / BIN_INDEX)
        elif (directory / BIN_SINGLE).is_file():
            self.kind, self._map = "bin", {k: BIN_SINGLE for k in self._open(BIN_SINGLE)}
        else:
            raise CheckpointError(
                f"{directory}: no weights found (expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or "
                f"{BIN_INDEX}){_way_forward(directory)}"
            )

    def _read_index(self, path: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: unreadable shard index ({_one_line(exc)})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path}: 'weight_map' is not a mapping")
        missing = sorted({str(v) for v in weight_map.values()} - {p.name for p in self.directory.iterdir()})
        if missing:
            raise CheckpointError(f"{path}: shard {missing[0]} listed in the index does not exist")
        return {str(k): str(v) for k, v in weight_map.items()}

    def _keys_of_safetensors(self, filename: str) -> dict[str, str]:
        return {k: filename for k in self._open(filename).keys()}

    def _open(self, filename: str) -> Any:
        if filename in self._handles:
            return self._handles[filename]
        path = self.directory / filename
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index does not exist")
        try:
            if filename.endswith(".safetensors"):
                from safetensors import safe_open

                handle: Any = safe_open(str(path), framework="pt", device="cpu")
            else:
                try:
                    handle = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):
                        raise
                    # legacy (non-zip) serialization cannot be memory-mapped
                    handle = torch.load(path, weights_only=True, map_location="cpu")
                if not isinstance(handle, dict):
                    raise CheckpointError(f"{path}: expected a state dict, got {type(handle).__name__}")
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read weights ({_one_line(exc)})") from None
        self._handles[filename] = handle
        return handle

    def keys(self) -> set[str]:
        """Every tensor name saved in the checkpoint."""
        return set(self._map)

    def get(self, key: str) -> torch.Tensor:
        """The saved tensor ``key`` (CPU, original dtype)."""
        if key not in self._map:
            raise CheckpointError(f"{self.directory}: tensor {key!r} is not in the checkpoint")
        handle = self._open(self._map[key])
        try:
            return handle.get_tensor(key) if self.kind == "safetensors" else handle[key]
        except Exception as exc:
            raise CheckpointError(f"{self.directory}: cannot read tensor {key!r} ({_one_line(exc)})") from None


def _way_forward(directory: Path) -> str:
    """What to do with a folder that holds weights attn_probe cannot read directly (or ``""``)."""
    try:
        names = {p.name for p in directory.iterdir()}
    except OSError:
        return ""
    if {"adapter_model.safetensors", "adapter_model.bin"} & names:
        return ("; it holds only a PEFT adapter: merge it into its base model "
                "(PeftModel.from_pretrained(base, path).merge_and_unload().save_pretrained(out)) and score that")
    if any(n.startswith("pytorch_model_fsdp") for n in names):
        return ("; it holds FSDP sharded state: save a full state dict (FSDP state_dict_type FULL_STATE_DICT, "
                "or `accelerate merge-weights` on the folder) and score that")
    if any(n.startswith("global_step") for n in names):
        return ("; it holds DeepSpeed ZeRO state: run the zero_to_fp32.py script saved in the folder to write "
                "full weights, save them with save_pretrained, and score that")
    return ""


def _key_resolver(saved: set[str], prefix: str) -> Callable[[str], str]:
    """Map skeleton parameter names to saved keys, allowing for a differing model-class prefix.

    A checkpoint saved from ``BertForMaskedLM`` stores ``bert.encoder...``, one saved from
    ``BertModel`` stores ``encoder...``; the skeleton may be either class.
    """

    def resolve(name: str) -> str:
        if name in saved:
            return name
        if prefix and f"{prefix}.{name}" in saved:
            return f"{prefix}.{name}"
        parts = name.split(".")
        for i in range(1, len(parts)):
            tail = ".".join(parts[i:])
            if tail in saved:
                return tail
            if prefix and f"{prefix}.{tail}" in saved:
                return f"{prefix}.{tail}"
        matches = [k for k in saved if k.endswith("." + name)]
        if len(matches) == 1:
            return matches[0]
        raise CheckpointError(f"parameter {name!r} of the model has no tensor in the checkpoint")

    return resolve


# --------------------------------------------------------------------------- skeleton
#: config.json keys holding a layer count (checked against the saved tensors)
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                    "num_encoder_layers", "num_decoder_layers")
_MAX_CONFIG_BYTES = 16 << 20  # a model configuration is far smaller


def check_layer_counts(directory: str | Path) -> None:
    """Refuse a ``config.json`` whose layer counts exceed the tensors saved beside it, before any model is built.

    Every layer of a model owns at least one saved tensor (ALBERT's shared layer counts once and
    its count stays below its tensors), so a count ``N`` > the number of saved tensors cannot
    describe these weights: a config claiming 1,000,000 layers for a 2-layer checkpoint would
    otherwise build a skeleton of that size, for minutes and gigabytes, before a tensor is read.
    Reads the JSON and the weight files' headers only. Raises
    :class:`~attn_probe.scoring.checkpoint.CheckpointError`; a directory without ``config.json`` passes
    (the scorer reports it).
    """
    directory = Path(directory).expanduser()
    config_path = directory / "config.json"
    if not config_path.is_file():
        return
    try:
        if config_path.stat().st_size > _MAX_CONFIG_BYTES:
            raise CheckpointError(f"{config_path}: {config_path.stat().st_size} bytes is not a model configuration")
        config = json.loads(config_path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{config_path}: unreadable ({type(exc).__name__}: {exc})") from None
    counts = []

    def walk(node: Any, where: str, depth: int) -> None:
        if not isinstance(node, dict) or depth > 4:
            return
        for key, value in node.items():
            if key in LAYER_COUNT_KEYS and isinstance(value, int) and not isinstance(value, bool):
                counts.append((f"{where}{key}", value))
            elif isinstance(value, dict):
                walk(value, f"{where}{key}.", depth + 1)

    walk(config, "", 0)
    if not counts:
        return
    tensors = len(CheckpointWeights(directory).keys())
    for key, value in counts:
        if value > tensors:
            raise CheckpointError(
                f"{config_path}: {key} = {value}, but the checkpoint holds {tensors} tensor"
                f"{'s' if tensors != 1 else ''} and every layer needs at least one; config.json does not "
                "describe these weights (corrupt or hostile)")


def _load_config(directory: Path) -> Any:
    if not (directory / "config.json").is_file():
        subs = sorted(p.name for p in directory.iterdir() if p.is_dir() and (p / "config.json").is_file())
        hint = f"; sub-directories with one: {', '.join(subs[:5])}" if subs else ""
        raise CheckpointError(
            f"{directory}: no config.json (is this a Hugging Face checkpoint directory?{hint})"
            f"{_way_forward(directory)}"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{directory}/config.json: {_one_line(exc)}") from None


def _build_skeleton(config: Any) -> torch.nn.Module:
    """The model of ``config`` on the meta device: its class from ``config.architectures``, else AutoModel."""
    import transformers

    errors = []
    builders: list[tuple[str, Callable[[], torch.nn.Module]]] = []
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(arch), None)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            builders.append((str(arch), lambda cls=cls: cls(config)))
    builders.append(("AutoModel", lambda: transformers.AutoModel.from_config(config)))
    for name, build in builders:
        try:
            with torch.device("meta"):
                model = build()
            return model.eval()
        except Exception as exc:
            errors.append(f"{name}: {_one_line(exc)}")
    model_type = getattr(config, "model_type", "?")
    raise CheckpointError(f"cannot build a model of type {model_type!r} ({'; '.join(errors)})")


def _progress(items: list[AttentionLayer], enabled: bool | None) -> Iterable[AttentionLayer]:
    show = sys.stderr.isatty() if enabled is None else enabled
    if not show:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc="scoring layers", unit="layer", file=sys.stderr)


# --------------------------------------------------------------------------- API
def open_checkpoint(
    path: str | Path,
    *,
    groups: Iterable[str] | None = None,
    layers: Iterable[int] | None = None,
    pairs: Sequence[ScorePair] | None = None,
) -> tuple[list[AttentionLayer], Callable[[AttentionLayer], ParamGetter]]:
    """The attention layers of a saved checkpoint directory, and a reader of one layer's tensors.

    The model is built on the meta device only to find its layers; ``tensors_of(layer)``
    reads exactly ``layer.param_names`` (with ``pairs``: every parameter the pairs declare)
    from the weight files and returns a getter for
    :meth:`~attn_probe.extraction.AttentionLayer.factors` / ``qk_matrix`` (or the pairs'
    ``factors``). With ``pairs``, every pair checks every layer first (the OV pair rejects an
    architecture whose W_v/W_o layout it does not know), before any tensor is read. Raises
    :class:`CheckpointError` for unusable input.
    """
    directory = Path(path).expanduser()
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such file or directory")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (pass the checkpoint directory)")
    check_layer_counts(directory)  # a hostile count is refused before a skeleton of that size is built
    config = _load_config(directory)
    weights = CheckpointWeights(directory)
    skeleton = _build_skeleton(config)
    try:
        found = find_attention(skeleton, groups=groups, layers=layers)
    except UnsupportedModelError as exc:
        raise CheckpointError(
            f"{directory}: no attention layer attn_probe can read in {type(skeleton).__name__}"
        ) from exc
    if not found:
        raise CheckpointError(f"{directory}: no attention layer matches the requested groups/layers")
    if pairs is not None:
        try:
            check_model_pairs(pairs, found, getattr(config, "model_type", None))
        except UnsupportedModelError as exc:
            raise CheckpointError(f"{directory}: {exc}") from None
    resolve = _key_resolver(weights.keys(), str(getattr(skeleton, "base_model_prefix", "") or ""))

    def tensors_of(layer: AttentionLayer) -> ParamGetter:
        names = pairs_param_names(pairs, layer) if pairs is not None else layer.param_names
        tensors = {name: weights.get(resolve(name)) for name in names}
        return tensors.__getitem__

    return found, tensors_of


def score_checkpoint(
    path: str | Path,
    per_head: bool = False,
    *,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
    groups: Iterable[str] | None = None,
    layers: Iterable[int] | None = None,
    progress: bool | None = None,
    metrics: Iterable[str] | None = None,
    pairs: PairsLike | None = None,
) -> list[Row]:
    """The metrics of every attention layer of a saved checkpoint directory (default: the six W_qk metrics).

    ``path`` holds ``config.json`` and ``model.safetensors`` (or shards listed in
    ``model.safetensors.index.json``, or ``pytorch_model.bin``). Rows are those of
    :func:`attn_probe.score_model` on the same model, with the same ``metrics`` and ``pairs``
    (``pairs=("qk", "ov")`` adds the ``ov_`` metrics of ``W_o^h W_v^h``); only one layer's
    tensors are in memory at a time. ``progress`` shows a tqdm bar on stderr (default: when
    stderr is a terminal). Raises :class:`CheckpointError` for unusable input, including an
    architecture a pair cannot read (checked before any tensor is read).

    Example:
        >>> rows = score_checkpoint("path/to/bert-base-uncased")  # doctest: +SKIP
        >>> summarize_rows(rows)[0]["symmetry_median"]  # doctest: +SKIP
    """
    num_std = float(num_std)
    if not math.isfinite(num_std):
        raise CheckpointError(f"num_std must be finite, got {num_std}")
    chosen = _pairs_or_error(pairs, metrics, dtype)
    found, tensors_of = open_checkpoint(path, groups=groups, layers=layers, pairs=chosen)
    rows: list[Row] = []
    with torch.no_grad():
        for layer in _progress(found, progress):
            get = tensors_of(layer)
            try:
                rows += score_layer_pairs(layer, get, chosen, per_head=per_head, num_std=num_std)
            except (ValueError, RuntimeError) as exc:
                raise CheckpointError(f"{Path(path).expanduser()}: {layer.name}: {_one_line(exc)}") from None
            del get
    return rows


def _pairs_or_error(pairs: PairsLike | None, metrics: Iterable[str] | None,
                    dtype: torch.dtype = torch.float32) -> list[ScorePair]:
    try:
        return resolve_pairs(pairs, metrics, dtype=dtype)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(str(exc)) from None


_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def find_checkpoints(paths: Iterable[str | Path], step: int | None = None) -> list[tuple[int | None, Path]]:
    """``(step, folder)`` for every checkpoint named by ``paths``, by step.

    A path that is a Trainer output directory (holding ``checkpoint-N`` folders and no
    ``config.json``) stands for all its checkpoints; a folder named ``checkpoint-N`` has step
    ``N``; any other folder takes ``step`` (only for a single path) or ``None``.
    """
    found: list[tuple[int | None, Path]] = []
    paths = [Path(p).expanduser() for p in paths]
    if not paths:
        raise CheckpointError("no checkpoint given")
    for path in paths:
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such file or directory" if not path.exists() else
                                  f"{path}: not a directory (pass the checkpoint directory)")
        subdirs = sorted((int(m.group(1)), d) for d in path.iterdir()
                         if d.is_dir() and (m := _CHECKPOINT_DIR.match(d.name)))
        if subdirs and not (path / "config.json").is_file():
            found.extend(subdirs)
            continue
        m = _CHECKPOINT_DIR.match(path.name)
        found.append((int(m.group(1)) if m else None, path))
    if step is not None:
        if len(found) != 1:
            raise CheckpointError("--step applies to a single checkpoint folder")
        found = [(int(step), found[0][1])]
    steps = [s for s, _ in found]
    if len(found) > 1:
        if None in steps:
            unnamed = next(p for s, p in found if s is None)
            raise CheckpointError(f"{unnamed}: cannot tell its step (not named checkpoint-N); "
                                  "score it alone with --step N")
        dupes = sorted({s for s in steps if steps.count(s) > 1})
        if dupes:
            raise CheckpointError(f"two checkpoints have step {dupes[0]}")
    return sorted(found, key=lambda item: (item[0] is None, item[0] or 0))


def write_checkpoint_trajectory(
    checkpoints: list[tuple[int | None, Path]],
    run_dir: str | Path,
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    metrics: Iterable[str] | None = None,
    progress: bool | None = None,
    pairs: PairsLike | None = None,
) -> list[Row]:
    """Score each checkpoint and write a run (``attn_probe.jsonl`` + TensorBoard events) at its step.

    The run reads back like a live one (:func:`attn_probe.load_trajectory`, ``attn-probe
    plot|summary``). ``metrics`` and ``pairs`` as for :func:`score_checkpoint` (with
    ``pairs=("qk", "ov")`` the run also holds the ``ov_`` metrics, as a live run with
    ``pairs=[QKPair(), OVPair()]`` does). One layer of one checkpoint is in memory at a time.
    Returns every row, each with its ``step``.
    """
    from ..sinks import RunInfo
    from ..sinks.tensorboard import TensorBoardSink
    from ..sinks.trajectory import TrajectorySink

    if any(step is None for step, _ in checkpoints):
        raise CheckpointError("every checkpoint needs a step to write a trajectory (name it checkpoint-N or "
                              "pass --step N)")
    chosen = _pairs_or_error(pairs, metrics)
    names = pair_metric_names(chosen)
    # the first checkpoint's layers (an unreadable architecture fails before the run exists); their
    # shapes go into the run header, as a live run's do, so the random range (and the emergence
    # events of ``attn-probe summary``) can be computed for this run from its header
    shapes = _layer_shapes(open_checkpoint(checkpoints[0][1], pairs=chosen)[0]) if checkpoints else []
    run_dir = Path(run_dir).expanduser()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{run_dir}: cannot create the run directory ({_one_line(exc)})") from None
    if (run_dir / "attn_probe.jsonl").exists():
        raise CheckpointError(f"{run_dir}: already holds a trajectory; give a new directory")
    all_rows: list[Row] = []
    sinks: list[Any] = []
    try:
        for i, (step, path) in enumerate(checkpoints):
            rows = score_checkpoint(path, per_head=per_head, num_std=num_std, pairs=chosen, progress=progress)
            if not sinks:
                groups = list(dict.fromkeys(r["group"] for r in rows))
                run = RunInfo(
                    config={"integration": "attn-probe score --trajectory", "metrics": list(names),
                            "pairs": [pair_label(p) for p in chosen],
                            "per_head": per_head, "num_std": num_std,
                            "checkpoints": [str(p) for _, p in checkpoints]},
                    model={"checkpoint": str(path), "attention_layers": shapes}, groups=groups, metrics=list(names), per_head=per_head,
                )
                sinks = [TensorBoardSink(str(run_dir)), TrajectorySink(str(run_dir))]
                for sink in sinks:
                    sink.start(run)
            snapshot = snapshot_from_rows(int(step), rows, names)
            for sink in sinks:
                sink.log(snapshot)
            all_rows += [{**r, "step": int(step)} for r in rows]
            if progress:
                print(f"scored {path} (step {step}, {i + 1}/{len(checkpoints)})", file=sys.stderr)
    finally:
        for sink in sinks:
            sink.finish()
    return all_rows


def _layer_shapes(layers: Iterable[AttentionLayer]) -> list[dict[str, Any]]:
    """The run header's ``attention_layers`` (the keys a live run writes, ``live/stages/outputs.py``)."""
    return [{"name": a.name, "group": a.group, "layer": a.layer, "num_heads": a.num_heads,
             "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "hidden_size": a.hidden_size}
            for a in layers]


def summarize_rows(rows: Iterable[Row]) -> list[dict[str, Any]]:
    """Paper-style summary: per group, median and interquartile range across layers.

    Uses the layer-level rows (``head is None``) and :func:`attn_probe.formats.tags.layer_stats`
    (quantiles interpolate linearly and skip ``nan``). One dict per group (in order of
    appearance) with ``group``, ``layers`` and ``{metric}_median``, ``{metric}_q25``,
    ``{metric}_q75`` for every metric in the rows.
    """
    by_group: dict[str, list[Row]] = {}
    for row in rows:
        if row.get("head") is None:
            by_group.setdefault(row["group"], []).append(row)
    out = []
    for group, items in by_group.items():
        entry: dict[str, Any] = {"group": group, "layers": len(items)}
        for score in row_metrics(items):
            stats = layer_stats(r[score] for r in items)
            entry.update({f"{score}_{stat}": value for stat, value in stats.items()})
        out.append(entry)
    return out
