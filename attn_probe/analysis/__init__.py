"""Post-hoc analysis of probe runs: load, export, summarise and plot trajectories.

pandas/pyarrow (``pip install attn-probe[pandas]``) and matplotlib (``[plot]``) are imported
inside the functions that need them, so importing this package stays light.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cli_errors", "add_runs_argument"]


def add_runs_argument(parser: argparse.ArgumentParser) -> None:
    """The ``RUN_DIR...`` positional shared by ``export``, ``plot`` and ``summary``.

    Each argument is a path or ``NAME=PATH`` (the runs at or below ``PATH`` are named ``NAME``),
    parsed into a :class:`~attn_probe.analysis.trajectory.NamedRun`.
    """
    from .trajectory import parse_run_argument

    parser.add_argument("runs", nargs="+", metavar="[NAME=]RUN_DIR", type=parse_run_argument,
                        help="run directories (attn_probe.jsonl or TensorBoard event files), parents of them, "
                             "or tables written by export; NAME=RUN_DIR names the run (default: the "
                             "directory's name, or a Trainer's output_dir name for its runs/<time>_<host>)")


@contextmanager
def cli_errors(command: str) -> Iterator[None]:
    """For CLI commands: bad input becomes a one-line ``CommandError``, warnings one line each.

    Catches the errors the analysis functions raise for user input (missing paths, no probe
    data, missing extras, bad formats) and prints warnings as ``attn-probe CMD: warning: ...``.
    """
    from ..cli import CommandError
    from .trajectory import MissingExtraError, TrajectoryError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except (TrajectoryError, MissingExtraError, FileNotFoundError, NotADirectoryError,
                PermissionError, ValueError) as exc:
            raise CommandError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
        finally:
            seen: set[str] = set()
            for w in caught:
                msg = str(w.message).splitlines()[0] if str(w.message) else ""
                if issubclass(w.category, (DeprecationWarning, FutureWarning)) or msg in seen:
                    continue
                seen.add(msg)
                print(f"attn-probe {command}: warning: {msg}", file=sys.stderr)
