"""Isolation: how the probe fails without stopping training (a leaf module: stdlib only).

* :func:`safe_warn`: ``warnings.warn`` that never raises (under ``python -W error`` the
  message goes to stderr instead);
* :class:`Failures`: counts a probe's failures and warns about the first one, with its
  traceback; later ones are counted, not reported;
* :func:`never_raise`: a method decorator that catches every exception of the method and
  reports it to the object's ``failure_log`` (a :class:`Failures`), returning ``None``.

Every module that must not raise into the user's training loop imports these from here.
"""

from __future__ import annotations

import functools
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["safe_warn", "Failures", "never_raise"]

F = TypeVar("F", bound=Callable[..., Any])


def safe_warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """``warnings.warn`` that never raises: under ``-W error`` the message goes to stderr instead."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Exception:  # noqa: BLE001 - a warning must never stop training
        try:
            print(f"{category.__name__}: {message}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - stderr closed: nothing left to tell
            pass


class Failures:
    """A probe's failure count; the first failure is warned about with its traceback."""

    def __init__(self) -> None:
        self.count = 0

    def report(self, what: str, exc: BaseException) -> None:
        """Count a failure of ``what``; warn about the first one. Never raises."""
        try:
            self.count += 1
            if self.count == 1:
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
