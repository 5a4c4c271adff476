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

__all__ = ["cli_errors", "add_runs_argument", "error_message"]


def add_runs_argument(parser: argparse.ArgumentParser) -> None:
    """The ``RUN_DIR...`` positional shared by ``export``, ``plot`` and ``summary``.

    Each argument is a path or ``NAME=PATH`` (the runs at or below ``PATH`` are named ``NAME``),
    parsed into a :class:`~attn_probe.analysis.trajectory.NamedRun`.
    """
    from .runs import parse_run_argument

    parser.add_argument("runs", nargs="+", metavar="[NAME=]RUN_DIR", type=parse_run_argument,
                        help="run directories (attn_probe.jsonl or TensorBoard event files), parents of them, "
                             "or tables written by export; NAME=RUN_DIR names the run (default: the "
                             "directory's name, or a Trainer's output_dir name for its runs/<time>_<host>)")


@contextmanager
def cli_errors(command: str) -> Iterator[None]:
    """For CLI commands: bad input becomes a one-line ``CommandError``, warnings one line each.

    Catches the errors the analysis functions raise for user input (missing paths, no probe
    data, missing extras, bad formats, files that cannot be written) and prints warnings as
    ``attn-probe CMD: warning: ...``. attn_probe's own messages are kept whole with control
    characters escaped (a run name may hold a newline or a terminal escape); other libraries'
    messages are cut to their first line. A checkpoint error caused by an unsupported model
    carries the reason (:func:`error_message`).
    """
    from ..cli import CommandError
    from ..formats.logdir import printable
    from .table import MissingExtraError, TrajectoryError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except (TrajectoryError, MissingExtraError, OSError, ValueError) as exc:
            raise CommandError(error_message(exc)) from exc
        except (MemoryError, RecursionError) as exc:  # a hostile input's size: one line, no traceback
            what = "out of memory" if isinstance(exc, MemoryError) else "input nested too deeply"
            raise CommandError(f"{what} while reading the runs; point at fewer or smaller runs") from exc
        finally:
            seen: set[str] = set()
            for w in caught:
                if issubclass(w.category, (DeprecationWarning, FutureWarning)):
                    continue
                ours = type(w.message).__module__.startswith("attn_probe")
                text = str(w.message) if ours else (str(w.message).splitlines() or [""])[0]
                msg = printable(text)
                if msg in seen:
                    continue
                seen.add(msg)
                print(f"attn-probe {command}: warning: {msg}", file=sys.stderr)


def error_message(exc: BaseException) -> str:
    """One terminal-safe line for a user-facing error.

    attn_probe's own errors are kept whole (escaped, :func:`attn_probe.formats.logdir.printable`);
    ``OSError`` is ``path: reason``; others are cut to their first line. When the error was
    caused by :class:`~attn_probe.extraction.UnsupportedModelError` (a checkpoint of Mamba or
    SqueezeBERT), its reason is appended.
    """
    from ..formats.logdir import printable

    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror and not type(exc).__module__.startswith("attn_probe"):
        where = exc.filename if exc.filename is not None else None
        text = f"{where}: {exc.strerror}" if where is not None else exc.strerror
    elif not type(exc).__module__.startswith("attn_probe"):
        text = (text.strip().splitlines() or [""])[0]
    cause = exc.__cause__
    if cause is not None and type(cause).__name__ == "UnsupportedModelError" and str(cause) not in text:
        text = f"{text}: {cause}"
    return printable(text or type(exc).__name__)
