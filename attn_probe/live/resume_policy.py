"""Which run directory a (resumed) training session writes: the policy, decided and carried out.

Paths, run ids and steps in, a decision out (:func:`choose_run`); no Trainer, no transformers, no
lightning. :func:`settle_run` carries the decision out for an integration through the small
:class:`RunDirs` adapter the integration implements by reading its framework's state (its default
TensorBoard directory, the directories of writers already open, and pointing a writer not yet open),
and returns the directory and the run's identity (:class:`RunPlan`), warning once where a user should
know. The Trainer callback (``TrainerDirs``) reads the saved run from the checkpoint's
``trainer_state.json`` (:func:`saved_run`); the Lightning callback (``LightningDirs``, a ``fixed``
directory: its logger's) from its own checkpoint state.

The rules (``docs/live-probe.md``, "Hugging Face Trainer"):

- ``log_dir=`` given: that directory. The checkpoint's run continues there when it holds the
  checkpoint's run id (or the checkpoint predates run ids); otherwise this is a new run whose
  parent is the checkpoint's run.
- a checkpoint with a saved run (and no ``TENSORBOARD_LOGGING_DIR``): the saved run continues
  where :func:`resolve_saved_run` finds it (under the current ``output_dir`` first, so a moved
  or copied output directory keeps its run); a run of *another* ``output_dir`` is never written
  (a branch: a new run, with the saved one as parent); a saved run that is gone or cannot be
  written gives a fresh run, with the saved one as parent.
- ``TENSORBOARD_LOGGING_DIR`` set (the user's directory, as ``log_dir=``): that directory (the
  Trainer's); a resume continues the checkpoint's run when the directory holds its run id (or the
  checkpoint predates run ids), else it is a new run whose parent is the checkpoint's run.
- otherwise the Trainer's TensorBoard run (a new run id).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

__all__ = ["LiveRunField", "Resolution", "RunChoice", "RunDirs", "RunPlan", "SavedRun", "choose_run", "fresh_dir", "holds_run",
           "identity", "last_run_id", "previous_runs", "resumed_line", "retry_dir", "settle_run",
           "relative_to", "resolve_saved_run", "same_path", "saved_run", "why_not_held"]


class SavedRun(NamedTuple):
    """The probe's run recorded with a checkpoint (``None`` where an older checkpoint recorded nothing)."""

    #: the run directory as used
    path: str
    #: that path relative to the run's ``output_dir``, when it lay inside it
    relative: str | None
    #: the ``output_dir`` of that run
    output_dir: str | None
    #: the run's id
    run_id: str | None


class Resolution(NamedTuple):
    """Where a saved run is now (:func:`resolve_saved_run`)."""

    #: the directory to continue, or ``None``
    directory: str | None
    #: why none was taken ("" when one was)
    problem: str
    #: the saved run belongs to another ``output_dir`` (never written: a branch)
    foreign: bool
    #: the directory was found under the current ``output_dir`` rather than at the saved path
    relocated: bool = False


@dataclass(frozen=True)
class RunChoice:
    """What :func:`choose_run` decided.

    ``kind``: ``"given"`` (``log_dir=``, in :attr:`directory`), ``"continue"`` (the saved run, found
    in :attr:`directory`), ``"branch"`` (a new run under this ``output_dir`` for another's
    checkpoint), ``"fresh"`` (a new run: the saved one is unusable, :attr:`problem` says why) or
    ``"default"`` (the Trainer's TensorBoard run). The identity: :attr:`run_id` is the id continued
    (``None``: a new one), :attr:`parent_id`/:attr:`parent_step` the run branched from (a parent
    id of ``None`` with ``parent_step`` set: a parent without id), :attr:`legacy` a continued run
    from a checkpoint written before run ids.
    """

    kind: str
    directory: str | None = None
    run_id: str | None = None
    parent_id: str | None = None
    parent_step: int | None = None
    legacy: bool = False
    problem: str = ""
    relocated: bool = False
    saved: SavedRun | None = None


class LiveRunField:
    """One field of a callback's live run (``run_id``, ``run_log_dir``, ...), held in the callback's
    ``_live_run`` dict, which only the callback itself writes.

    An assignment from outside lands in the callback's ``restored_attributes`` instead, as
    information about a checkpoint: transformers' ``Trainer._load_callback_state``
    (``restore_callback_states_from_checkpoint=True``) sets a checkpoint's saved attributes on the
    live callback, and the checkpoint of another run (a branch's parent) must not become this
    run's identity (its checkpoints would then record the parent's id, and a resume would take the
    parent's run for its own). The identity is decided at train begin (:func:`choose_run`), from
    the checkpoint's record in ``trainer_state.json`` against the runs the trajectory holds.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, owner: Any, cls: type | None = None) -> Any:
        if owner is None:
            return self
        return owner.__dict__.get("_live_run", {}).get(self.name)

    def __set__(self, owner: Any, value: Any) -> None:
        owner.__dict__.setdefault("restored_attributes", {})[self.name] = value


def saved_run(stateful_callbacks: Mapping[str, Any] | None, name: str = "AttnProbeCallback") -> SavedRun | None:
    """The probe's run recorded in a checkpoint's ``stateful_callbacks`` (``trainer_state.json``), if any."""
    saved = (stateful_callbacks or {}).get(name)
    if isinstance(saved, list):
        saved = saved[-1] if saved else None
    if not isinstance(saved, dict):
        return None
    attributes = saved.get("attributes") or {}
    value, relative = attributes.get("run_log_dir"), attributes.get("run_log_dir_relative")
    if not (isinstance(value, str) and value):
        return None
    relative = relative if isinstance(relative, str) and relative and not os.path.isabs(relative) else None
    output_dir = attributes.get("run_output_dir")
    run_id = attributes.get("run_id")
    return SavedRun(value, relative, output_dir if isinstance(output_dir, str) and output_dir else None,
                    run_id if isinstance(run_id, str) and run_id else None)


def relative_to(path: str, root: Any) -> str | None:
    """``path`` relative to ``root`` when it lies inside it (``"."`` for ``root`` itself), else ``None``."""
    try:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(str(root)))
    except ValueError:  # another drive (Windows)
        return None
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return None
    return rel


def same_path(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same place (user-expanded, links resolved)."""
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def holds_run(directory: str, run_id: str) -> bool:
    """Whether ``directory``'s trajectory holds the run ``run_id`` (a directory without a
    trajectory file, or one that cannot be read, holds no run)."""
    from ..formats.trajectory import TRAJECTORY_FILENAME, file_runs

    try:
        return any(h.run_id == run_id for h in file_runs(os.path.join(directory, TRAJECTORY_FILENAME)))
    except (OSError, MemoryError):
        return False


def last_run_id(directory: str) -> str | None:
    """The id of the last run in ``directory``'s trajectory (``None``: no file, or no run header)."""
    from ..formats.trajectory import TRAJECTORY_FILENAME, file_runs

    try:
        runs = file_runs(os.path.join(directory, TRAJECTORY_FILENAME))
    except (OSError, MemoryError):
        return None
    return runs[-1].run_id if runs else None


def why_not_held(directory: str, run_id: str) -> str:
    """One clause saying why ``directory`` does not hold the run ``run_id`` (for a resume message):
    no trajectory file, a file without run headers, or headers of other runs only."""
    from ..formats.trajectory import TRAJECTORY_FILENAME, file_runs

    path = os.path.join(directory, TRAJECTORY_FILENAME)
    if not os.path.isfile(path):
        return f"{path} no longer exists"
    try:
        ids = sorted({h.run_id for h in file_runs(path)})
    except (OSError, MemoryError) as exc:
        return f"{path} cannot be read ({exc})"
    if not ids:
        return (f"{path} holds no readable run header: the header of run {run_id} saved with the checkpoint "
                "was deleted or damaged")
    listed = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
    return (f"{path} holds no header of run {run_id} saved with the checkpoint, only of {listed}: another run's "
            "file, or that header was edited or damaged")


def resolve_saved_run(saved: SavedRun | tuple[str, str | None, str | None, str | None], output_dir: Any) -> Resolution:
    """Where the saved run is now.

    In order: the recorded relative path under the *current* ``output_dir`` (the output
    directory may have been moved or copied since); the recorded path itself; for checkpoints
    that recorded only that path, the same trailing components (``runs/<name>``) under the
    current ``output_dir`` when they hold a trajectory. A directory is taken only when it exists
    and can be written (:func:`attn_probe.formats.logdir.check_log_dir`): a run directory is never
    recreated where a moved or deleted one was. A directory outside the current ``output_dir``
    is taken only when the checkpoint's own ``output_dir`` is the current one (its run had an
    explicit ``log_dir``): ``foreign`` says the saved run belongs to another ``output_dir``
    (a run branched from another run's checkpoint), which is never written; it is decided by
    where the run was recorded, not by what the directories hold. When the checkpoint records a
    run id, a directory whose trajectory does not hold that run is never taken, whatever its
    name: two runs whose directories have the same name (started in the same second) stay two,
    and ``problem`` says what the directory holds instead (a deleted, edited or damaged header).
    """
    from ..formats.logdir import LogDirError, check_log_dir
    from ..formats.trajectory import TRAJECTORY_FILENAME

    path, relative, saved_output_dir, run_id = saved
    output_dir = str(output_dir)
    same_output_dir = saved_output_dir is not None and same_path(saved_output_dir, output_dir)

    def inside(candidate: str) -> bool:
        return same_output_dir or relative_to(os.path.realpath(candidate), os.path.realpath(output_dir)) is not None

    candidates = []
    if relative is not None:
        candidates.append(os.path.normpath(os.path.join(output_dir, relative)))
    candidates.append(path)
    if relative is None and not os.path.isdir(path):
        parts = [p for p in os.path.normpath(path).split(os.sep) if p]
        for n in range(min(3, len(parts) - 1), 0, -1):
            tail = os.path.join(output_dir, *parts[-n:])
            if os.path.isfile(os.path.join(tail, TRAJECTORY_FILENAME)):
                candidates.append(tail)
                break
    problem = "it no longer exists"
    for candidate in candidates:
        if not os.path.isdir(candidate) or not inside(candidate):
            continue
        if run_id is not None and not holds_run(candidate, run_id):
            problem = why_not_held(candidate, run_id)
            continue
        try:
            check_log_dir(candidate)
        except LogDirError as exc:
            problem = str(exc)
            continue
        return Resolution(candidate, "", False, relocated=candidate not in (path, candidates[0]))
    return Resolution(None, problem, not inside(path))


def choose_run(step: int, saved: SavedRun | None, *, log_dir: str | None, output_dir: Any,
               trainer_dir_from_env: bool = False, trainer_dir: str | None = None) -> RunChoice:
    """The run directory and identity of a session starting at ``step`` (see the module docstring).

    ``saved``: the checkpoint's run (:func:`saved_run`; ``None`` at step 0 or without one);
    ``log_dir``: the user's ``log_dir=``; ``trainer_dir_from_env``: ``TENSORBOARD_LOGGING_DIR``
    is set (the Trainer's directory is then the user's choice, and a saved run is not looked for
    elsewhere); ``trainer_dir``: that directory, where a resume continues the checkpoint's run when
    it holds its id (a resume into the same directory must cut its own stale rows: issue 29 cuts
    by run id).
    """
    if step <= 0:
        saved = None
    if log_dir is not None:
        chosen = os.path.expanduser(log_dir)
        if saved is not None and saved.run_id is not None and not holds_run(chosen, saved.run_id):
            # the checkpoint's run is elsewhere: a new run, its child
            return RunChoice("given", chosen, parent_id=saved.run_id, parent_step=step, saved=saved)
        if saved is not None:
            return RunChoice("given", chosen, run_id=saved.run_id, legacy=saved.run_id is None, saved=saved)
        return RunChoice("given", chosen)
    if saved is not None and trainer_dir_from_env and trainer_dir is not None:
        if saved.run_id is not None and not holds_run(os.path.expanduser(trainer_dir), saved.run_id):
            return RunChoice("default", parent_id=saved.run_id, parent_step=step, saved=saved)
        return RunChoice("default", run_id=saved.run_id, legacy=saved.run_id is None, saved=saved)
    if saved is not None and not trainer_dir_from_env:
        found = resolve_saved_run(saved, output_dir)
        if found.directory is None and found.foreign:
            return RunChoice("branch", parent_id=saved.run_id, parent_step=step, saved=saved)
        if found.directory is None:
            return RunChoice("fresh", parent_id=saved.run_id, parent_step=step, problem=found.problem, saved=saved)
        return RunChoice("continue", found.directory, run_id=saved.run_id, legacy=saved.run_id is None,
                         relocated=found.relocated, saved=saved)
    return RunChoice("default", saved=saved)


def previous_runs(output_dir: str, current: str) -> list[str]:
    """Earlier probe runs under ``output_dir/runs`` (those holding a trajectory), oldest first."""
    from ..formats.trajectory import TRAJECTORY_FILENAME

    root = os.path.join(str(output_dir), "runs")
    try:
        entries = [os.path.join(root, e) for e in os.listdir(root)]
    except OSError:
        return []
    runs = [e for e in entries if os.path.isfile(os.path.join(e, TRAJECTORY_FILENAME))
            and os.path.realpath(e) != os.path.realpath(current)]
    return sorted(runs, key=os.path.getmtime)


# ------------------------------------------------------------------ carrying the decision out
class RunDirs(Protocol):
    """What a framework tells the policy about its TensorBoard run, read from its own state.

    Each integration implements it (the Trainer's ``TensorBoardCallback``, Lightning's
    ``TensorBoardLogger``); :func:`settle_run` carries the decision out through it and nothing else.
    ``fixed``: the framework's directory is final (Lightning: its logger's version directory, or
    ``log_dir=``): a checkpoint's run continues there when the directory holds it, and is never
    looked for elsewhere.
    """

    fixed: ClassVar[bool]

    def default_dir(self) -> str | None:
        """The framework's own TensorBoard run directory (where the probe writes by default)."""

    def open_dirs(self) -> list[str]:
        """The directories of the framework's TensorBoard writers already open."""

    def point(self, directory: str) -> None:
        """Make the framework's TensorBoard writers that are not open yet write to ``directory``."""


@dataclass
class RunPlan:
    """What :func:`settle_run` chose: the directory, and the run's identity.

    :attr:`identity`: the run-header fields (``run_id``, ``parent_run_id``, ``parent_step``,
    ``continues_unidentified``); :attr:`parent_run` ``(parent directory, step)`` for a branch or a
    resumed run in another directory; :attr:`from_checkpoint`: the directory is the checkpoint's
    run (given up for a fresh one by :func:`retry_dir` if it cannot be written);
    :attr:`continues`: the checkpoint's run continues (by id); :attr:`lost`: why a checkpoint's
    run in the same directory is not continued (Lightning's message); :attr:`chosen_by_default`:
    the framework's default directory, which a unique sibling replaces when another run is using it.
    """

    directory: str | None
    identity: dict[str, Any]
    parent_run: tuple[str, int] | None = None
    from_checkpoint: bool = False
    continues: bool = False
    lost: str = ""
    chosen_by_default: bool = False

    @property
    def run_id(self) -> str | None:
        return self.identity.get("run_id")


def identity(run_id: str | None, *, parent: str | None = None, step: int | None = None,
             legacy: bool = False) -> dict[str, Any]:
    """The run-header identity fields: ``run_id`` (continued, or a new one), the parent run
    (its id and the step branched at) and ``continues_unidentified`` for a resume from a
    checkpoint written before run ids (whose rows carry no header: the new id continues them)."""
    from ..formats.trajectory import new_run_id

    fields: dict[str, Any] = {"run_id": run_id or new_run_id()}
    if parent is not None:
        fields.update(parent_run_id=parent, parent_step=step)
    if legacy:
        fields["continues_unidentified"] = True
    return fields


def _warn(message: str) -> None:
    from ..isolation import safe_warn

    safe_warn(message, RuntimeWarning, stacklevel=4)


def settle_run(step: int, saved: SavedRun | None, dirs: RunDirs, *, log_dir: str | None, output_dir: Any,
               env_dir: str | None = None) -> RunPlan:
    """The run directory and identity of a Trainer session starting at ``step``, carried out.

    :func:`choose_run` decides; this points the framework's TensorBoard writer (``dirs``) where
    the probe writes when it is not open yet, takes a unique sibling rather than another run's
    files, and warns once for a relocated, branched, fresh or unrecorded run. ``env_dir``: the
    framework's directory set by the user (``TENSORBOARD_LOGGING_DIR``), where a resume
    continues the checkpoint's run only when it holds its id.
    """
    saved = saved if step > 0 else None
    if dirs.fixed:
        return _settle_fixed(step, saved, os.path.expanduser(log_dir) if log_dir is not None else dirs.default_dir())
    choice = choose_run(step, saved, log_dir=log_dir, output_dir=output_dir,
                        trainer_dir_from_env=env_dir is not None, trainer_dir=env_dir)
    plan = RunPlan(None, identity(choice.run_id, parent=choice.parent_id, step=choice.parent_step,
                                  legacy=choice.legacy), chosen_by_default=log_dir is None and env_dir is None)
    if choice.kind == "given":
        if env_dir is None:
            # with attach() this runs before the TensorBoard writer opens: the loss goes to the same run
            dirs.point(choice.directory)
        plan.directory = choice.directory
    elif choice.kind == "branch":
        plan.directory = _unused_dir(dirs.default_dir(), dirs)
        plan.parent_run = (saved.path, step)
        plan.identity = identity(None, parent=saved.run_id, step=step)
        where = f" ({saved.output_dir})" if saved.output_dir else ""
        which = f" (run id {saved.run_id})" if saved.run_id else ""
        _warn(f"attn_probe: branched from the probe's run {saved.path} at step {step}{which}: the checkpoint's "
              f"run was recorded under another output_dir{where}, whose run this run cannot continue or modify; "
              f"logging continues from step {step} in a new run directory {plan.directory} "
              f"(run id {plan.run_id}).")
    elif choice.kind == "fresh":
        plan.directory = fresh_dir(plan, dirs, step, output_dir, saved.path, choice.problem, saved.run_id)
    elif choice.kind == "continue":
        found = plan.directory = choice.directory
        plan.from_checkpoint = True
        if choice.relocated:
            _warn(f"attn_probe: the probe's run saved with the checkpoint, {saved.path}, no longer exists; "
                  f"continuing the run found at the same place under output_dir, {found}.")
        dirs.point(found)  # the trajectory stays one run: the framework's writer too, if not open yet
        elsewhere = set(dirs.open_dirs()) - {found}
        if elsewhere:
            _warn(f"attn_probe: resuming the probe's run in {found} (saved with the checkpoint); the "
                  f"Trainer's TensorBoard logs of this session go to {', '.join(sorted(elsewhere))}. "
                  "Use attn_probe.attach(trainer, ...) (or set TENSORBOARD_LOGGING_DIR) to keep both in one run.")
    else:
        plan.directory = dirs.default_dir()
        if step > 0 and saved is None:
            previous = previous_runs(output_dir, plan.directory)
            if previous:
                _warn(f"attn_probe: resuming at step {step} in a new run directory {plan.directory}; "
                      f"the checkpoint names no earlier probe run (the earlier run may be {previous[-1]}). "
                      "Give log_dir= to continue a run.")
    return plan


def _settle_fixed(step: int, saved: SavedRun | None, where: str) -> RunPlan:
    """A framework whose directory is final (:attr:`RunDirs.fixed`): the checkpoint's run continues
    in ``where`` when its trajectory holds the checkpoint's run id; a checkpoint of an earlier
    version, without a run id, continues only in its own directory (with that run's last id)."""
    from ..formats.trajectory import new_run_id

    parent, saved_id = (saved.path, saved.run_id) if saved is not None else (None, None)
    lost = ""
    if saved_id is not None:  # the run is its id: a directory's name never decides
        continues = holds_run(where, saved_id)
        lost = "" if continues or not same_path(parent or "", where) else why_not_held(where, saved_id)
        run_id: str | None = saved_id if continues else new_run_id()
    else:
        continues = parent is not None and same_path(parent, where)
        run_id = last_run_id(where) if continues else new_run_id()  # None: rows without header
    fields: dict[str, Any] = {} if run_id is None else {"run_id": run_id}
    plan = RunPlan(where, fields, continues=continues, lost=lost)
    if parent is not None and not continues:
        fields.update(parent_run=parent, parent_step=step, parent_run_id=saved_id)
        plan.parent_run = (parent, step)
    return plan


def resumed_line(plan: RunPlan, step: int, where: str | None, *, skipped: bool) -> None:
    """One line for a framework with a final directory (:func:`_settle_fixed`) resumed from a checkpoint
    of a run it does not continue: where the trajectory goes on, and why."""
    from ..isolation import print_line

    if plan.parent_run is None:
        return
    why = (f"a new run there, since {plan.lost}" if plan.lost else
           "a new logger version; TensorBoardLogger(version=...) keeps one directory")
    print_line(f"attn_probe: resumed at step {step} from a checkpoint of the run in {plan.parent_run[0]}; the "
               f"trajectory continues {'after' if skipped else 'from'} step {step} in {where} ({why}).")


def fresh_dir(plan: RunPlan, dirs: RunDirs, step: int, output_dir: Any, saved: str, problem: str,
              saved_id: str | None = None) -> str:
    """A new run directory for a resumed run whose saved one is unusable (``problem``); warns once,
    naming both. The run gets a new id (in ``plan``), with the checkpoint's run as its parent: the
    framework's TensorBoard run of this session when its writer is open, else a new default one."""
    from ..formats.logdir import LogDirError, default_log_dir, unique_log_dir

    plan.identity = identity(None, parent=saved_id, step=step)
    plan.from_checkpoint = False
    opened = dirs.open_dirs()
    if opened:  # the framework's TensorBoard run of this session (callbacks=[...]): join it
        log_dir = opened[0]
    else:
        log_dir = os.path.join(str(output_dir), default_log_dir())
        if os.path.lexists(log_dir):  # the unusable run itself, if it started in this second
            try:
                log_dir = unique_log_dir(log_dir)
            except LogDirError:
                pass  # the probe's own check names the problem
        dirs.point(log_dir)
    _warn(f"attn_probe: cannot continue the probe's run saved with the checkpoint, {saved} ({problem}); "
          f"logging continues from step {step} in a new run directory {log_dir}. The steps before "
          f"{step} stay in the earlier run (wherever it now is); pass log_dir= to choose the directory.")
    return log_dir


def retry_dir(plan: RunPlan, error: Exception, dirs: RunDirs, step: int, output_dir: Any) -> str | None:
    """Where to write after the probe refused ``plan.directory`` with ``error``, or ``None`` (raise it).

    The default directory in use by another run (a second Trainer started in the same second): a
    unique sibling. The checkpoint's run that cannot be written (permissions, a read-only mount, a
    file in the way): a resumed run must not fail for that, it continues in a fresh directory.
    """
    from ..formats.logdir import LogDirError, LogDirInUseError, unique_log_dir

    if plan.directory is None:
        return None
    if isinstance(error, LogDirInUseError):
        if not plan.chosen_by_default:
            return None
        taken, plan.directory = plan.directory, unique_log_dir(plan.directory)
        _warn(f"attn_probe: {taken} is in use by another run; this probe writes to {plan.directory}")
        return plan.directory
    if isinstance(error, LogDirError) and plan.from_checkpoint:
        plan.directory = fresh_dir(plan, dirs, step, output_dir, plan.directory, str(error), plan.run_id)
        return plan.directory
    return None


def _unused_dir(log_dir: str, dirs: RunDirs) -> str:
    """``log_dir``, or a unique sibling when it already holds another run's files (and the
    framework's TensorBoard writer is not open there): a new run never writes another run's files."""
    from ..formats.events import has_event_files
    from ..formats.logdir import LogDirError, unique_log_dir
    from ..formats.trajectory import TRAJECTORY_FILENAME

    opened = {os.path.realpath(d) for d in dirs.open_dirs()}
    if os.path.realpath(log_dir) in opened or not (
            os.path.isfile(os.path.join(log_dir, TRAJECTORY_FILENAME)) or has_event_files(log_dir)):
        return log_dir
    try:
        chosen = unique_log_dir(log_dir)
    except LogDirError:
        return log_dir  # the probe's own check names the problem
    dirs.point(chosen)
    return chosen
