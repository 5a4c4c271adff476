"""Weights & Biases sink: the probe's values in a W&B run, never at the cost of the user's own logs.

Where the values go (docs/live-probe.md, "W&B: what it receives"):

* **A run of the probe's own (the default beside a run of yours).** Given your run (``run=``,
  ``wandb.run``, the Trainer's, the accelerator's or Lightning's ``WandbLogger``'s W&B run), the
  sink creates a run of its own with ``wandb.init(resume="allow", ...)``: same project, entity,
  mode and directory, your run's group (``job_type="attn_probe"``, named ``<your run>-attn_probe``,
  your run's id in its config under ``attn_probe/user_run``, its id derived from yours so that a
  resumed run of yours resumes it). Every snapshot is a row of its own there, and nothing is
  logged into your run: the only lossless way through W&B's public API, whatever you log.
* **Joining your run** (``separate_run=False``): each snapshot goes in with
  ``run.log(values, commit=False)`` and no ``step=``, so it joins the row you commit next and
  never moves a row boundary of yours. Two snapshots between two of your commits land in one
  row, where the later overwrites the earlier: those are counted (from W&B's public
  ``run.step``, read on the sink's own lane) and told once at ``close()``.
* **A run the sink creates** (no run of yours, or ``init_kwargs``): rows of its own.

Every run the probe creates lives in a child process of its own
(:mod:`attn_probe.sinks.wandb_process`): a W&B run started in the training process would become
W&B's most recent active run there, which a plain ``wandb.init()`` of yours returns (and, with
``mode="disabled"``, ``wandb.run``). So ``wandb.run``, ``wandb.log``, ``wandb.config`` and
``wandb.init()`` stay exactly what they are without the probe. A disabled run of yours (or
``mode="disabled"``) records nothing: the probe then creates no run at all.

Keys: the TensorBoard tags (``attn_probe/...``) plotted against ``attn_probe/step``
(``define_metric``). A second probe joining the same run of yours gets ``attn_probe_2/...``
(and ``attn_probe_2/step``), so no two probes share a key. Only public W&B API is used
(``wandb.init``, ``run.log``, ``run.step``, ``run.define_metric``, ``run.config``,
``run.finish``); no lock of the sink's is ever waited on by a thread of yours. A background sink:
everything after ``start()`` runs on its lane, so a slow or hung W&B service never stalls a
training step. ``wandb`` is imported in :meth:`WandbSink.start` (``pip install 'attn-probe[wandb]'``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from typing import Any

from ..formats.tags import PREFIX
from ..isolation import print_line, safe_warn
from . import RunInfo, Snapshot
from .tracker_record import STEP_KEY, TrackerRun, wandb_run
from .trackers import TrackerSink
from .wandb_process import ChildRun, reserve

__all__ = ["WandbSink", "JoinedRows", "define_probe_axis", "probe_run_id", "JOB_TYPE"]

#: ``job_type`` of the probe's own W&B runs
JOB_TYPE = "attn_probe"
#: how the loss warning names the lossless way
LOSSLESS_WAY = (
    "leave separate_run at its default (WandbSink(run); with the Trainer or Accelerate, "
    "wandb_separate_run=True): the probe then logs into a W&B run of its own, grouped with yours"
)

# the key prefixes taken in each W&B run of a user, so that two probes never share a key; held
# only around these few dictionary operations (no W&B call, no user thread ever takes it)
_TAKEN: dict[tuple[str, str], set[str]] = {}
_TAKEN_LOCK = threading.Lock()


def _run_key(run: Any) -> tuple[str, str]:
    return str(getattr(run, "project", "") or ""), str(run.id)


def claim_namespace(run: Any) -> str:
    """The key prefix of a new probe in ``run``: ``attn_probe``, else ``attn_probe_2``, ``_3``, ..."""
    key = _run_key(run)
    with _TAKEN_LOCK:
        taken = _TAKEN.setdefault(key, set())
        n = 1
        while (PREFIX if n == 1 else f"{PREFIX}_{n}") in taken:
            n += 1
        namespace = PREFIX if n == 1 else f"{PREFIX}_{n}"
        taken.add(namespace)
    return namespace


def release_namespace(key: tuple[str, str], namespace: str) -> None:
    with _TAKEN_LOCK:
        taken = _TAKEN.get(key)
        if taken is not None:
            taken.discard(namespace)
            if not taken:
                del _TAKEN[key]


def define_probe_axis(run: Any, namespace: str = PREFIX) -> None:
    """Plot ``<namespace>/*`` against ``<namespace>/step`` in a W&B run (the x-axis of those charts only)."""
    run.define_metric(f"{namespace}/step")
    run.define_metric(f"{namespace}/*", step_metric=f"{namespace}/step")


def probe_run_id(user_run_id: str, namespace: str = PREFIX) -> str:
    """The id of the probe's own run beside the user's: ``<user run id>-<namespace>`` (a hash when that
    is not a valid W&B id). The same user run gives the same id, so a resumed run resumes the probe's."""
    text = f"{user_run_id}-{namespace}"
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        return text
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _steps_text(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    shown = ", ".join(str(s) for s in steps[:12])
    return f"steps {shown}" + (f", ... {steps[-1]}" if len(steps) > 12 else "")


class JoinedRows:
    """The probe's snapshots joining the rows of a W&B run that someone else commits.

    Each snapshot is logged with ``run.log(values, commit=False)`` and no ``step=``: it joins the
    row open at that moment, which its owner commits; no row boundary of theirs moves, no log
    of theirs is dropped. A row keeps one value per key, so of two snapshots in one row only
    the later reaches W&B. Which row a snapshot joins is read from W&B's public ``run.step``
    (the step of the row open now: a round-trip to the W&B service, on the sink's lane) just
    before and just after its ``log``: when both reads agree the row is known. A snapshot is
    counted ``lost`` when the next one is known to have joined its row, ``maybe_lost`` when the
    owner committed during one of the two ``log`` calls, so that the rows cannot be told apart
    (or ``run.step`` could not be read: W&B's ``mode="shared"``). Nothing here takes a lock.
    """

    def __init__(self, run: Any, label: str) -> None:
        self.run = run
        self.label = label
        self.sent = 0
        #: probe steps overwritten in a row (certain), and those that may have been
        self.lost: list[int] = []
        self.maybe_lost: list[int] = []
        #: the last snapshot sent: (probe step, W&B step before its log, W&B step after it)
        self._last: tuple[int, int | None, int | None] | None = None

    def _wandb_step(self) -> int | None:
        try:
            return int(self.run.step)
        except Exception:  # noqa: BLE001 - a shared-mode run, a timeout: this row cannot be told
            return None

    def send(self, values: dict[str, Any], step: int) -> None:
        before = self._wandb_step()
        self.run.log(values, commit=False)
        after = self._wandb_step()
        self.sent += 1
        last, self._last = self._last, (int(step), before, after)
        if last is None:
            return
        last_step, last_before, last_after = last
        if last_after is not None and before is not None and last_after < before:
            return  # a row was committed in between: the earlier snapshot's row is closed, it reached W&B
        if (
            None not in (last_before, last_after, before, after)
            and last_before == last_after == before == after
        ):
            self.lost.append(last_step)  # both known to be in the same row: the later overwrote it
        else:
            self.maybe_lost.append(last_step)

    def report(self) -> None:
        """One warning with the count and the steps of the snapshots that did not reach W&B (if any)."""
        if not self.lost and not self.maybe_lost:
            return
        text = (
            f"attn_probe: {len(self.lost)} of the probe's {self.sent} snapshots did not reach {self.label}"
            + (f" ({_steps_text(self.lost)})" if self.lost else "")
        )
        if self.maybe_lost:
            text += (
                f"; {len(self.maybe_lost)} more may not have ({_steps_text(self.maybe_lost)}: a row was "
                "committed while they were logged, so which row each joined is unknown)"
            )
        safe_warn(
            text + ". Joining your run (separate_run=False), a snapshot shares the row you commit next and "
            "is overwritten by the next snapshot when you commit no row in between; attn_probe.jsonl and "
            f"TensorBoard hold every snapshot. To lose none, {LOSSLESS_WAY}."
        )


class WandbSink(TrackerSink):
    """Send snapshots to W&B (the module docstring says where and how).

    ``run``: your run (``wandb.init(...)``'s result; or a callable returning it, called at
    ``start()``); without it, the active run (``wandb.run``) unless ``init_kwargs`` are given.
    ``separate_run`` (default: ``True`` when there is a run of yours): the probe logs into a run
    of its own beside yours, created on the sink's lane at its first snapshot and finished by
    :meth:`finish`; ``False``: it joins your run's rows (:class:`JoinedRows`: snapshots between
    two of your commits are lost, counted and told at close). Without a run of yours the sink
    creates one with ``wandb.init(**init_kwargs)`` and finishes it. ``per_head`` also sends one
    series per head. ``log_config`` records the probe's configuration under
    ``config["attn_probe"]`` of the run the values go to (joining: ``config[<prefix>]`` of yours).
    ``init_kwargs`` override the settings of the probe's own run.

    Example:
        >>> run = wandb.init(project="my-project")                      # doctest: +SKIP
        >>> with attn_probe.watch(model, optimizer=opt, log_dir="runs/x", every=100,
        ...                       sinks=[WandbSink(run)]):              # doctest: +SKIP
        ...     train()
    """

    module = "wandb"
    extra = "wandb"
    #: driven from the dispatcher's lane: after ``start()`` every W&B call is made there
    background = True
    #: the probe's own run is created at the first snapshot, on the lane: the guard is made then
    guard_at_first_log = True

    def __init__(
        self,
        run: Any = None,
        *,
        per_head: bool = False,
        log_config: bool = True,
        separate_run: bool | None = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__(per_head=per_head)
        self._given = run
        self._init_kwargs = init_kwargs
        self._log_config = log_config
        self.separate_run = separate_run
        #: ``"separate"``, ``"join"``, ``"own"`` (a run the sink created), or ``None`` (nothing to log into)
        self.mode: str | None = None
        #: the run of the user's the values go beside (separate) or into (join)
        self.user_run: Any = None
        #: the key prefix (``attn_probe``; ``attn_probe_2``, ... for later probes joining one run)
        self.namespace = PREFIX
        #: ``wandb.init`` arguments of the probe's own run, until it is created
        self.probe_run_kwargs: dict[str, Any] | None = None
        self.joined: JoinedRows | None = None
        self._claim: tuple[tuple[str, str], str] | None = None
        #: the place reserved for the probe's run in its process (until the run is created)
        self._place: Any = None
        self._ready = False

    # ------------------------------------------------------------------ start (training thread)
    def _user_run(self, wandb: Any) -> Any:
        given = self._given
        if callable(given) and not hasattr(given, "log"):
            return given()
        if given is not None:
            return given
        return None if self._init_kwargs else getattr(wandb, "run", None)

    def _open(self, run_info: RunInfo) -> None:
        wandb = self._import()
        self.run, self.owns_run, self._ready = None, False, False
        self.joined, self.probe_run_kwargs, self.namespace = None, None, PREFIX
        found_by_tracker = callable(self._given) and not hasattr(self._given, "log")
        try:
            user = self._user_run(wandb)
        except Exception as exc:  # noqa: BLE001 - the tracker's own set-up failed: never stop training for it
            if not found_by_tracker:
                raise
            user, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "the tracker did not start one"
        self.user_run = user
        if user is None and found_by_tracker:
            self.mode = None
            safe_warn(
                f"attn_probe: found no W&B run to log beside ({why}); the probe sends nothing to W&B "
                "(attn_probe.jsonl and TensorBoard hold every snapshot)."
            )
            return
        if user is None:
            kwargs = dict(self._init_kwargs)
            if self.separate_run:
                safe_warn(
                    "attn_probe: WandbSink(separate_run=True) found no W&B run of yours (pass run= or call "
                    "wandb.init first); the probe's run is created from W&B's settings alone."
                )
                kwargs = {"job_type": JOB_TYPE, **kwargs}
            if _disabled(kwargs.get("mode")):
                self.mode = None
                _status("W&B is disabled (mode='disabled'): the probe sends nothing to W&B")
                return
            self.mode, self.probe_run_kwargs = "own", kwargs
            self._place = _reserve()
            return
        if self.separate_run is not False and _disabled(
            getattr(getattr(user, "settings", None), "mode", None)
        ):
            self.mode = None
            _status(f"your W&B run {user.id} is disabled (mode='disabled'): the probe sends nothing to W&B")
            return
        self.namespace = claim_namespace(user)
        self._claim = (_run_key(user), self.namespace)
        if self.separate_run is False:
            self.mode = "join"
            self.joined = JoinedRows(user, f"W&B run {user.id}")
            _status(
                f"the probe's values join the rows of W&B run {user.id} under {self.namespace}/ "
                "(separate_run=False: a snapshot between two of your commits is overwritten by the next, "
                "counted and told at close)"
            )
        else:
            self.mode = "separate"
            self.probe_run_kwargs = self._separate_kwargs(user, run_info)
            self._place = _reserve()
            _status(
                f"the probe logs into a W&B run of its own, {self.probe_run_kwargs.get('name')} "
                f"(id {self.probe_run_kwargs.get('id')}), beside W&B run {user.id}"
                + (f" in group {user.group}" if getattr(user, "group", None) else "")
                + "; nothing is logged into yours"
            )

    def _config_value(self, run_info: RunInfo) -> dict[str, Any]:
        # plain JSON values (what W&B's config holds anyway): they travel to the run's process
        value = json.loads(json.dumps({"config": run_info.config, "model": run_info.model}, default=str))
        return {PREFIX if self.mode != "join" else self.namespace: value}

    def _separate_kwargs(self, user: Any, run_info: RunInfo) -> dict[str, Any]:
        """``wandb.init`` arguments of the probe's own run: beside the user's run, in its group."""
        config: dict[str, Any] = {f"{PREFIX}/user_run": str(user.id)}
        if self._log_config:
            config.update(self._config_value(run_info))
        kwargs: dict[str, Any] = {
            "resume": "allow",
            "job_type": JOB_TYPE,
            "id": probe_run_id(str(user.id), self.namespace),
            "project": user.project,
            "entity": getattr(user, "entity", None) or None,
            "name": f"{getattr(user, 'name', None) or user.id}-{self.namespace}",
            "config": config,
        }
        if getattr(user, "group", None):
            kwargs["group"] = user.group
        settings = getattr(user, "settings", None)
        mode = {"dryrun": "offline", "run": "online"}.get(
            getattr(settings, "mode", None), getattr(settings, "mode", None)
        )
        if mode in ("online", "offline", "disabled"):
            kwargs["mode"] = mode
        root = getattr(settings, "root_dir", None)
        if root:
            kwargs["dir"] = root
        kwargs.update(self._init_kwargs)
        return kwargs

    # ------------------------------------------------------------------ the lane
    def _ensure_ready(self) -> None:
        """On the lane, before the first snapshot: create the probe's run, or set up the joined one."""
        if self._ready:
            return
        if self.mode in ("separate", "own"):
            if self.run is None:  # in a process of its own: never one of this process's W&B runs
                place, self._place = self._place, None
                self.run, self.owns_run = ChildRun(self.probe_run_kwargs, place), True
            define_probe_axis(self.run)
            if self.mode == "own" and self._log_config and self.run_info is not None:
                self.run.config.update(self._config_value(self.run_info), allow_val_change=True)
        elif self.mode == "join":
            define_probe_axis(self.user_run, self.namespace)
            if self._log_config and self.run_info is not None:
                self.user_run.config.update(self._config_value(self.run_info), allow_val_change=True)
        self._ready = True

    def log(self, snapshot: Snapshot) -> None:
        if self.mode is None:
            return
        self._ensure_ready()
        super().log(snapshot)

    def _tracker_run(self) -> TrackerRun:
        if self.mode == "join":
            return wandb_run(self.user_run, step_key=f"{self.namespace}/step")
        return wandb_run(self.run)

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:
        step = int(snapshot.step)
        if self.mode == "join":
            cut = len(PREFIX)
            payload = {self.namespace + key[cut:]: value for key, value in values.items()}
            payload[f"{self.namespace}/step"] = step
            self.joined.send(payload, step)
        else:
            self.run.log({**values, STEP_KEY: step}, commit=True)

    @property
    def lost_steps(self) -> list[int]:
        """Joining a run of yours: the probe steps known not to have reached W&B (empty otherwise)."""
        return list(self.joined.lost) if self.joined is not None else []

    def _close(self) -> None:
        run, self.run = self.run, None
        claim, self._claim = self._claim, None
        place, self._place = self._place, None
        try:
            if place is not None:  # no snapshot came: the run was never created
                place.release()
            if self.joined is not None:
                self.joined.report()
            if self.owns_run and run is not None:
                run.finish()
        finally:
            if claim is not None:
                release_namespace(*claim)


def _reserve() -> Any:
    """A place in the process of the probe's W&B runs, started now so that W&B's import overlaps
    training (the run itself is created at the first snapshot, on the lane). ``None`` if it cannot
    start here: the lane tries again and its failure is counted there, never on the training thread."""
    try:
        return reserve()
    except Exception:  # noqa: BLE001
        return None


def _disabled(mode: Any) -> bool:
    """Whether W&B runs in ``mode`` (else in ``WANDB_MODE``) are disabled: they record nothing."""
    return (mode or os.environ.get("WANDB_MODE")) == "disabled"


def _status(text: str) -> None:
    """One status line, printed like the probe's own start line (clear of progress bars, never raising)."""
    print_line(f"attn_probe: {text}")
