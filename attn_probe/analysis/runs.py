"""Run discovery: which run directories a path names (an iterative walk bounded in depth) and
the names runs get (``NAME=PATH``, the directory's name, a Trainer's ``output_dir`` name).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from ..formats.events import is_event_file
from ..formats.trajectory import TRAJECTORY_FILENAME
from .table import (
    PathLike,
    RunsLike,
    TrajectoryError,
)

#: how deep below a given path run directories are looked for (a Trainer's output_dir/runs/<run>
#: is 2 deep; a sweep of sweeps a few more)
MAX_DEPTH = 64


#: a file marking a directory as a reference written for TensorBoard (the demo's ``paper-<name>``
#: runs: the paper's trajectories, not a probe run); a walk below a given path skips it silently
REFERENCE_MARKER = "attn_probe_reference.txt"


def _run_dirs_below(root: Path) -> list[Path]:
    """Run directories at or below ``root``, in sorted depth-first order.

    A directory holding ``attn_probe.jsonl`` is one run, and event files below it (a
    logging sub-directory) belong to it; directories below it with their own trajectory
    file are separate runs. The walk is iterative, follows symbolic links to directories
    but enters each directory once (a link loop is skipped), skips directories below ``root``
    that hold :data:`REFERENCE_MARKER` (with everything below them), and raises
    :class:`TrajectoryError` (one line) below :data:`MAX_DEPTH` levels.
    """
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[Path, bool, int]] = [(root, False, 0)]
    while stack:
        d, covered, depth = stack.pop()
        try:
            st = d.stat()
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue  # entered already: a symbolic link loop, or a second link to it
            seen.add(key)
            entries = sorted(d.iterdir())
        except (OSError, RuntimeError):
            continue
        if depth and any(e.name == REFERENCE_MARKER for e in entries):
            continue  # a reference written for TensorBoard beside the runs, not a run
        has_traj = (d / TRAJECTORY_FILENAME).is_file()
        if has_traj or (not covered and any(is_event_file(e.name) and e.is_file() for e in entries)):
            found.append(d)
        subdirs = [e for e in entries if _is_dir(e)]
        if subdirs and depth >= MAX_DEPTH:
            from ..formats.logdir import printable

            raise TrajectoryError(
                f"{printable(root)}: directories nested more than {MAX_DEPTH} levels deep below it "
                f"(at {printable(subdirs[0].relative_to(root).parts[0])}/...); point at the run "
                "directories themselves, or at a parent nearer them")
        stack.extend((e, covered or has_traj, depth + 1) for e in reversed(subdirs))
    return found


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


#: a Trainer's default TensorBoard run directory: ``<Mon DD_HH-MM-SS>_<host>`` (SummaryWriter's
#: default, possibly with the ``_N`` of :func:`attn_probe.formats.logdir.unique_log_dir`) under ``runs/``
_TRAINER_RUN = re.compile(r"^[^\W\d_]+\d{2}_\d{2}-\d{2}-\d{2}_.+$")


class NamedRun(os.PathLike):
    """A run path with the name the user gave it (``NAME=PATH`` on the command line).

    A path everywhere (``os.fspath``); :func:`find_runs` names the runs at or below it
    ``NAME`` (``NAME/sub`` for nested runs), like a ``{name: path}`` mapping.
    """

    def __init__(self, name: str, path: PathLike) -> None:
        self.name = str(name)
        self.path = os.fspath(path)

    def __fspath__(self) -> str:
        return self.path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedRun) and (self.name, self.path) == (other.name, other.path)

    def __hash__(self) -> int:
        return hash((self.name, self.path))

    def __repr__(self) -> str:
        return f"NamedRun({self.name!r}, {self.path!r})"


def parse_run_argument(text: str) -> str | NamedRun:
    """``NAME=PATH`` as a :class:`NamedRun`; anything else (an existing path included) as is.

    An argument that exists as a path stays a path even if it contains ``=``; ``NAME`` may
    not contain a path separator.
    """
    if "=" in text and not os.path.exists(text):
        name, path = text.split("=", 1)
        if name and path and "/" not in name and os.sep not in name:
            return NamedRun(name, path)
    return text


def trainer_output_dir(run_dir: Path) -> Path | None:
    """``output_dir`` when ``run_dir`` is a Trainer's default ``output_dir/runs/<time>_<host>``."""
    d = run_dir.resolve()
    if d.parent.name == "runs" and _TRAINER_RUN.match(d.name) and d.parent.parent.name:
        return d.parent.parent
    return None


def _name_parts(paths: list[Path]) -> list[tuple[str, ...]]:
    """Path components to name each run by (the name is the last one, or more on a clash).

    A Trainer's default run directory is named after its ``output_dir``; several of them
    under one ``output_dir`` keep their directory's name after it (``out/Nov23_...``).
    """
    outputs = [trainer_output_dir(p) for p in paths]
    parts = []
    for p, out in zip(paths, outputs, strict=True):
        if out is None:
            parts.append(p.resolve().parts)
        elif outputs.count(out) > 1:
            parts.append((*out.parts[:-1], f"{out.name}/{p.resolve().name}"))
        else:
            parts.append(out.parts)
    return parts


def _unique_names(paths: list[Path], taken: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Run names (see :func:`_name_parts`), lengthened with parent directories until they are
    unique; names still shared, or already ``taken`` by a named run, get ``#2``, ``#3``..."""
    parts = _name_parts(paths)
    depth = [1] * len(paths)
    while True:
        names = ["/".join(pt[-k:]) for pt, k in zip(parts, depth, strict=True)]
        clash = {n for n in names if names.count(n) > 1}
        grow = [i for i, n in enumerate(names) if n in clash and depth[i] < len(parts[i])]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    seen: dict[str, int] = {n: 1 for n in taken}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        name = n if seen[n] == 1 else f"{n}#{seen[n]}"
        while name != n and name in seen:
            seen[n] += 1
            name = f"{n}#{seen[n]}"
        seen.setdefault(name, 1)
        out.append(name)
    return out


def find_runs(runs: RunsLike) -> list[tuple[str, Path]]:
    """``(name, directory)`` of every run directory at or below the given paths.

    The name is the directory's name; a Trainer's default run directory
    (``output_dir/runs/<time>_<host>``) is named after ``output_dir``. Names are lengthened
    with parent directories where two runs would otherwise share one. A mapping
    ``{name: path}`` or a :class:`NamedRun` (``NAME=PATH`` on the command line) names runs
    explicitly: the run at or below the path is ``name``, several runs below it ``name/sub``.
    Raises ``FileNotFoundError`` for a missing path and :class:`TrajectoryError` when no run
    directory is found at all or a name is given twice.
    """
    if isinstance(runs, Mapping):
        items: list[tuple[str | None, Path]] = [(str(k), Path(v)) for k, v in runs.items()]
    elif isinstance(runs, (str, os.PathLike)):
        items = [(runs.name if isinstance(runs, NamedRun) else None, Path(runs))]
    else:
        items = [(r.name if isinstance(r, NamedRun) else None, Path(r)) for r in runs]
    if not items:
        raise TrajectoryError("no run directory given")
    given = [k for k, _ in items if k is not None]
    twice = sorted({k for k in given if given.count(k) > 1})
    if twice:
        raise TrajectoryError(f"run name given twice: {', '.join(twice)}")
    named: list[tuple[str, Path]] = []
    unnamed: list[Path] = []
    seen: set[Path] = set()
    for key, root in items:
        if not root.exists():
            raise FileNotFoundError(f"no such directory: {root}")
        single = root.is_file()
        if single:
            if root.name == TRAJECTORY_FILENAME or is_event_file(root.name):
                root = root.parent  # that run only, not the directories below it
            else:
                raise TrajectoryError(
                    f"{root} is a file; expected a run directory (with {TRAJECTORY_FILENAME} "
                    "or TensorBoard event files) or an exported table (.csv, .parquet, .jsonl)"
                )
        dirs = [d for d in ([root] if single else _run_dirs_below(root)) if d.resolve() not in seen]
        seen.update(d.resolve() for d in dirs)
        for d in dirs:
            if key is None:
                unnamed.append(d)
            else:
                rel = d.relative_to(root).as_posix()
                # the one run below a named path (a Trainer's output_dir) takes the name itself
                named.append((key if rel == "." or len(dirs) == 1 else f"{key}/{rel}", d))
    if not named and not unnamed:
        given_paths = ", ".join(str(p) for _, p in items)
        raise TrajectoryError(
            f"no probe data in {given_paths}: no {TRAJECTORY_FILENAME} and no TensorBoard event "
            "files at or below it"
        )
    taken = {n for n, _ in named}
    return named + list(zip(_unique_names(unnamed, taken), unnamed, strict=True))
