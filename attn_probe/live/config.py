"""The probe's options, validated once: :class:`ProbeConfig`.

Every entry point (:func:`attn_probe.watch`, :class:`attn_probe.AttnProbeCallback`,
:class:`attn_probe.Probe`) builds one ``ProbeConfig`` from its keyword arguments when it is
called, so a misspelled or invalid option raises ``TypeError``/``ValueError`` there, not
when training starts. The config is frozen and passed whole, from the entry point through
the integrations to the probe and its stages; nothing validates an option a second time.
What it measures is recorded in the run's header (:meth:`ProbeConfig.record`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import DEFAULT_METRICS
from ..core.update import UPDATE_METRIC
from ..scoring.model import resolve_pairs
from ..scoring.pairs import QKPair
from ..sinks.dispatch import DEFAULT_QUEUE_SIZE, DEFAULT_TIMEOUT
from .asynchronous import DEFAULT_ASYNC_BYTES
from .schedules import Schedule, ScheduleLike, as_schedule
from .stages.update import split_update_metric, with_update_pair

__all__ = ["ProbeConfig", "config_from_options"]

IMAGE_MODES = ("downsample", "block")


def _int_tuple(name: str, value: Iterable[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of ints, got {type(value).__name__}")
    out = tuple(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise TypeError(f"{name} must contain ints, got {list(out)!r}")
    return out


def _str_tuple(name: str, value: Iterable[str] | str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    out = tuple(value)
    if not all(isinstance(v, str) for v in out):
        raise TypeError(f"{name} must contain strings, got {list(out)!r}")
    return out


#: the most bytes ``extra_config`` may take in the run header (as JSON); a header line stays
#: well under the readers' limit (:data:`attn_probe.formats.runs.MAX_HEADER`)
MAX_EXTRA_CONFIG = 256 << 10
#: how deep ``extra_config`` may nest
_MAX_DEPTH = 32


def _check_extra_config(extra: Mapping[str, Any]) -> None:
    """Refuse, with one line naming the key, what the run header cannot hold exactly as JSON: NaN
    and infinities, objects that are not JSON (str/int/float/bool/None, lists, dicts with string
    keys), nesting deeper than 32, more than :data:`MAX_EXTRA_CONFIG` bytes in all."""
    import json

    def where(path: tuple) -> str:
        return "extra_config" + "".join(f"[{p!r}]" for p in path)

    def check(value: Any, path: tuple) -> None:
        if len(path) > _MAX_DEPTH:
            raise ValueError(f"{where(path[:_MAX_DEPTH])} nests deeper than {_MAX_DEPTH} levels: the run header "
                             "cannot hold it")
        if value is None or isinstance(value, (bool, int, str)):
            return
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{where(path)} is {value!r}: the run header is JSON, which has no NaN or "
                                 "infinity; pass a finite number, None or a string")
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(f"{where(path)} has the key {k!r} ({type(k).__name__}): the run header is "
                                    "JSON, whose keys are strings")
                check(v, (*path, k))
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, (*path, i))
            return
        raise TypeError(f"{where(path)} is a {type(value).__name__} ({_short(value)}): the run header is JSON; "
                        "pass str, int, float, bool, None, or lists and dicts of them (str(value) for other objects)")

    check(extra, ())
    size = len(json.dumps(extra, allow_nan=False))
    if size > MAX_EXTRA_CONFIG:
        raise ValueError(f"extra_config takes {size} bytes as JSON, over the {MAX_EXTRA_CONFIG} the run header "
                         "holds; store large data beside the run and name its path in extra_config")


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails must not hide the message
        text = object.__repr__(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ProbeConfig:
    """What the probe measures and when. All fields are keyword options of ``watch`` and the callback.

    * ``every``: snapshot schedule: an int ``n`` (every ``n`` updates), a callable
      ``step -> bool`` (:mod:`attn_probe.live.schedules`), or ``None`` (only by hand);
    * ``metrics``: metric names of the W_qk pair (:data:`attn_probe.core.METRICS`), and ``qk_update``,
      W_qk's relative change since the previous snapshot (:mod:`attn_probe.live.stages.update`);
    * ``per_head``: also log every head's ``M_h``;
    * ``groups`` / ``layers``: restrict to these attention groups / layer indices;
    * ``num_std``: directionality threshold, ``mean + num_std * std``;
    * ``images_every``, ``image_size``, ``image_mode``: W_qk heatmap images in TensorBoard;
    * ``pairs``: score pairs (:mod:`attn_probe.scoring.pairs`) or their names (``"qk"``, ``"ov"``, which
      get ``metrics``); default the W_qk pair with ``metrics``;
    * ``start_step``: the counter's first value (resume);
    * ``find_kwargs``: extra arguments of :func:`attn_probe.find_attention` (``qk_names``...);
    * ``agreement_timeout``: seconds a sharded run's ranks wait for each other in the probe's
      agreements (``docs/distributed.md``); default the training process group's timeout;
    * ``attention_stats``: also measure ``max_logit`` and ``entropy`` from the activations on due
      steps (:mod:`attn_probe.activations.statistics`, ``docs/scores.md``), with the QK-clip dry run
      against ``qk_clip_tau`` (MuonClip's tau, default 100; :mod:`attn_probe.live.stages.qk_clip`);
      ``attention_entropy_rows``: above this many query rows in one attention call (default 256),
      the entropy of a call without padding or mask beyond causality is averaged over a
      systematic sample of about that many rows (``max_logit`` always reads every row; error
      bound in :mod:`attn_probe.activations.logits`); ``None``: every row;
      ``attention_flex_compiled``: also measure ``flex_attention`` calls inside a compiled graph
      (torchtitan 0.3's inductor-compiled flex, your ``torch.compile`` of a flex model) by tracing
      your ``mask_mod``/``score_mod`` into it, the arithmetic in opaque operators (a failure
      drops that step's values, warned once and counted); off by default because a modifier the
      compiler cannot trace at all would break a ``fullgraph=True`` compile (flex called eagerly is
      always measured; :mod:`attn_probe.activations.flex`);
    * ``alerts``: :class:`~attn_probe.live.alerts.AlertRule` s on logged metrics; ``alert_callback``
      (called with each :class:`~attn_probe.live.alerts.Alert`, main process); ``stop_on_alert``: a
      fired alert stops the Trainer (``control.should_training_stop``, with a checkpoint when its
      ``save_strategy`` saves), every rank at the same step (``docs/live-probe.md``); rules that
      can never fire are refused when the probe is built;
    * ``random_range``: write the random-matrix range of every layer's shape (``random_symmetry``,
      ``random_directionality`` and their ``_sd``) into the trajectory once, with a fresh run's
      first snapshot (:mod:`attn_probe.baselines.random_range`, ``docs/scores.md``); ``False``: not.

    Where it goes and how it is written (not recorded in the run header):

    * ``log_dir``, ``writer`` (a ``SummaryWriter`` to write into), ``sinks`` (more sinks),
      ``purge_stale``; ``is_main_process`` (default: global rank 0); ``extra_config`` (added
      to the run header: JSON values only, finite numbers, at most 256 KiB; anything else is
      refused here with one line naming the key); ``tracker_top_k``: with per-head values, the
      trackers get per layer the min/median/max over heads and this many top heads with their
      ids (``None``: no per-head summary; ``docs/tags.md``; recorded in the header, where the
      tracker sinks read it); ``restart``: the run starts over at ``start_step`` even when it is
      0 (a Trainer re-entering its loop): trajectory rows from there on are dropped;
    * ``background``, ``sink_queue``, ``sink_timeout``: the sinks' lanes
      (:class:`~attn_probe.sinks.dispatch.SinkDispatcher`);
    * ``async_scoring``, ``async_max_bytes``: score off the training thread
      (:mod:`attn_probe.live.asynchronous`).
    """

    every: ScheduleLike | None = 100
    metrics: tuple[str, ...] = DEFAULT_METRICS
    per_head: bool = False
    groups: tuple[str, ...] | None = None
    layers: tuple[int, ...] | None = None
    num_std: float = 2.0
    images_every: ScheduleLike | None = None
    image_size: int = 128
    image_mode: str = "downsample"
    pairs: tuple[Any, ...] | None = None
    start_step: int = 0
    find_kwargs: Mapping[str, Any] = field(default_factory=dict)
    agreement_timeout: float | None = None
    attention_stats: bool = False
    alerts: tuple[Any, ...] = ()
    alert_callback: Any = None
    stop_on_alert: bool = False
    random_range: bool = True
    qk_clip_tau: float = 100.0
    attention_entropy_rows: int | None = 256
    attention_flex_compiled: bool = False
    # -- where it goes, how it is written
    log_dir: str | None = None
    writer: Any = None
    sinks: tuple[Any, ...] | None = None
    is_main_process: bool | None = None
    extra_config: Mapping[str, Any] | None = None
    purge_stale: bool = True
    restart: bool = False
    tracker_top_k: int | None = 3
    background: bool = True
    sink_queue: int = DEFAULT_QUEUE_SIZE
    sink_timeout: float = DEFAULT_TIMEOUT
    async_scoring: bool = False
    async_max_bytes: int = DEFAULT_ASYNC_BYTES

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        self._check_writing()
        as_schedule(self.every)  # raises TypeError/ValueError for a bad schedule
        as_schedule(self.images_every)
        set_(self, "metrics", split_update_metric(self.metrics)[0])  # the core's names and qk_update
        if not isinstance(self.per_head, bool):
            raise TypeError(f"per_head must be True or False, got {self.per_head!r}")
        set_(self, "groups", _str_tuple("groups", self.groups))
        set_(self, "layers", _int_tuple("layers", self.layers))
        if isinstance(self.num_std, bool) or not isinstance(self.num_std, (int, float)) \
                or not math.isfinite(self.num_std):
            raise ValueError(f"num_std must be a finite number, got {self.num_std!r}")
        set_(self, "num_std", float(self.num_std))
        if isinstance(self.image_size, bool) or not isinstance(self.image_size, int) or self.image_size < 1:
            raise ValueError(f"image_size must be a positive int, got {self.image_size!r}")
        if self.image_mode not in IMAGE_MODES:
            raise ValueError(f"image_mode must be 'downsample' or 'block', got {self.image_mode!r}")
        if self.pairs is not None:
            pairs = (self.pairs,) if isinstance(self.pairs, str) else tuple(self.pairs)
            if not pairs:
                raise ValueError("pairs is empty: nothing would be measured; leave it out for the W_qk pair")
            if any(isinstance(p, str) for p in pairs):  # "qk", "ov": named pairs with ``metrics``
                core = tuple(m for m in self.metrics if m != UPDATE_METRIC)
                pairs = tuple(with_update_pair(resolve_pairs(pairs, core),
                                               "qk" in pairs and UPDATE_METRIC in self.metrics))
            for p in pairs:
                if not (hasattr(p, "metrics") and callable(getattr(p, "score", None))):
                    raise TypeError(f"pairs must hold score pairs (attn_probe.scoring.pairs.ScorePair), got {p!r}")
            set_(self, "pairs", pairs)
        if isinstance(self.start_step, bool) or not isinstance(self.start_step, int) or self.start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {self.start_step!r}")
        if not isinstance(self.find_kwargs, Mapping):
            raise TypeError(f"find_kwargs must be a dict, got {type(self.find_kwargs).__name__}")
        set_(self, "find_kwargs", dict(self.find_kwargs))
        if self.agreement_timeout is not None:
            t = self.agreement_timeout
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"agreement_timeout must be a positive number of seconds or None, got {t!r}")
            set_(self, "agreement_timeout", float(t))
        for name in ("attention_stats", "stop_on_alert", "random_range", "attention_flex_compiled"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        rows = self.attention_entropy_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"attention_entropy_rows must be a positive int or None, got {rows!r}")
        from .stages.qk_clip import check_tau

        set_(self, "qk_clip_tau", check_tau(self.qk_clip_tau))
        from .alerts import check_rules

        set_(self, "alerts", check_rules(self.alerts))
        if self.alert_callback is not None and not callable(self.alert_callback):
            raise TypeError(f"alert_callback must be callable, got {self.alert_callback!r}")

    def _check_writing(self) -> None:
        """The writing and scoring options; every message names the option."""
        set_ = object.__setattr__
        q = self.sink_queue
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ValueError(f"sink_queue must be an int >= 1, got {q!r}")
        for name in ("background", "async_scoring", "restart", "purge_stale"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        t = self.sink_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"sink_timeout must be a finite number of seconds > 0, got {t!r}")
        b = self.async_max_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"async_max_bytes must be an int >= 0, got {b!r}")
        k = self.tracker_top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"tracker_top_k must be an int >= 0 or None, got {k!r}")
        if self.sinks is not None:
            set_(self, "sinks", tuple(self.sinks))
        if self.is_main_process is not None:
            set_(self, "is_main_process", bool(self.is_main_process))
        if self.extra_config is not None:
            if not isinstance(self.extra_config, Mapping):
                raise TypeError(f"extra_config must be a dict, got {type(self.extra_config).__name__}")
            _check_extra_config(self.extra_config)

    @property
    def schedule(self) -> Schedule | None:
        return as_schedule(self.every)

    @property
    def image_schedule(self) -> Schedule | None:
        return as_schedule(self.images_every)

    def score_pairs(self) -> list[Any]:
        """The pairs to score: ``pairs`` if given, else the W_qk pair with ``metrics``; with ``qk_update``
        among ``metrics`` also a fresh :class:`~attn_probe.live.stages.update.QKUpdatePair` (per call)."""
        if self.pairs is not None:
            return with_update_pair(list(self.pairs), False)
        core = tuple(m for m in self.metrics if m != UPDATE_METRIC)
        return with_update_pair([QKPair(core)] if core else [], UPDATE_METRIC in self.metrics)

    def replace(self, **changes: Any) -> ProbeConfig:
        """A copy with ``changes`` (validated like the constructor's options)."""
        return config_from_options(self, **changes)

    def record(self) -> dict[str, Any]:
        """JSON-able form for the run header (callables by their qualified name)."""

        def name(value: Any) -> Any:
            return getattr(value, "__qualname__", repr(value)) if callable(value) else value

        return {
            "every": name(self.every),
            "metrics": list(self.metrics),
            "per_head": self.per_head,
            "num_std": self.num_std,
            "images_every": name(self.images_every),
            "image_size": self.image_size,
            "image_mode": self.image_mode,
            "start_step": self.start_step,
            "agreement_timeout": self.agreement_timeout,
            "attention_stats": self.attention_stats,
            "alerts": [rule.describe() + f" on {rule.metric}" for rule in self.alerts],
            "random_range": self.random_range,
            "qk_clip_tau": self.qk_clip_tau,
            "attention_entropy_rows": self.attention_entropy_rows,
            "attention_flex_compiled": self.attention_flex_compiled,
            "tracker_top_k": self.tracker_top_k,
        }


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ProbeConfig))


def config_from_options(base: ProbeConfig | None = None, /, *, allowed_extra: Sequence[str] = (),
                        **options: Any) -> ProbeConfig:
    """``ProbeConfig`` from keyword options (over ``base``); ``TypeError`` naming the valid options."""
    unknown = [k for k in options if k not in OPTION_NAMES]
    if unknown:
        valid = sorted(set(OPTION_NAMES) | set(allowed_extra))
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, valid, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(
            f"attn_probe: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
            f"valid options: {', '.join(valid)}"
        )
    if base is None:
        return ProbeConfig(**options)
    return dataclasses.replace(base, **options)
