"""Isolation: how the probe fails without stopping training (a leaf module: stdlib only).

* :func:`safe_warn`: ``warnings.warn`` that never raises (under ``python -W error`` the
  message goes to stderr instead);
* :class:`Failures`: counts a probe's failures and warns about the first one, with its
  traceback; later ones are counted, not reported;
* :func:`never_raise`: a method decorator that catches every exception of the method and
  reports it to the object's ``failure_log`` (a :class:`Failures`), returning ``None``;
* :func:`print_line`: one line on stderr that never raises;
* :func:`clear_of_progress_bars`: what is written inside it starts on a line of its own, not
  glued to a progress bar (the Trainer's, or any tqdm bar on the terminal).

``safe_warn`` and ``print_line`` write clear of progress bars.

Every module that must not raise into the user's training loop imports these from here.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["safe_warn", "Failures", "never_raise", "print_line", "clear_of_progress_bars"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def clear_of_progress_bars() -> Iterator[None]:
    """Clear tqdm's progress bars while the body writes to the terminal, and redraw them after.

    A bar is drawn with ``\\r`` and no final newline, so a line written while it shows would be
    glued to it (``39/60 [01:04<00:37, 1.77s/it]attn_probe alert at step 40: ...``). tqdm's
    public ``external_write_mode`` clears every bar on stdout or stderr and redraws them on exit;
    all tqdm classes (``tqdm.auto``'s, the Trainer's, Lightning's) register their bars with
    ``tqdm.std.tqdm``. It is used with ``nolock=True``: the training thread never waits for a
    bar's lock (a bar redrawn at the same instant by another thread may share a line with the
    text, but nothing waits). When tqdm was never imported there is no bar, and nothing is done.
    Never raises; other progress displays (``rich``) are not covered.
    """
    bar_class = getattr(sys.modules.get("tqdm.std"), "tqdm", None)
    mode = None
    if bar_class is not None:
        try:
            mode = bar_class.external_write_mode(file=sys.stderr, nolock=True)
            mode.__enter__()
        except Exception:  # noqa: BLE001 - a bar that cannot be cleared must not stop the line
            mode = None
    try:
        yield
    finally:
        if mode is not None:
            try:
                mode.__exit__(None, None, None)
            except Exception:  # noqa: BLE001
                pass


def print_line(line: str) -> None:
    """One line on stderr, clear of progress bars, never raising (a closed stderr loses it)."""
    try:
        with clear_of_progress_bars():
            print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - reporting must never stop training
        pass


def safe_warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """``warnings.warn`` that never raises: under ``-W error`` the message goes to stderr instead.

    The warning is written clear of progress bars (:func:`clear_of_progress_bars`).
    """
    try:
        with clear_of_progress_bars():
            warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Exception:  # noqa: BLE001 - a warning must never stop training
        print_line(f"{category.__name__}: {message}")


class Failures:
    """A probe's failure count; the first failure is warned about with its traceback."""

    warned = False  # also for an instance unpickled from before the attribute existed

    def __init__(self) -> None:
        self.count = 0
        self.warned = False

    def report(self, what: str, exc: BaseException) -> None:
        """Count a failure of ``what``; warn about the first one reported here (failures that
        others counted and warned about themselves, ``count += 1``, do not silence it). Never raises."""
        try:
            self.count += 1
            if not self.warned:
                self.warned = True
                safe_warn(
                    f"attn_probe: {what} failed ({type(exc).__name__}: {exc}); that snapshot "
                    "is skipped and training continues. Later failures are counted, not reported.\n"
                    + "".join(traceback.format_exception(exc)),
                    stacklevel=3,
                )
        except Exception:  # noqa: BLE001
            pass


def never_raise(method: F) -> F:
    """Catch every exception of ``method``: report it to ``self.failure_log``, return ``None``.

    The report itself cannot raise (:func:`safe_warn`), so this holds under ``python -W error``.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the probe must never stop training
            self.failure_log.report(method.__name__, exc)
            return None

    return wrapper  # type: ignore[return-value]
