"""Scoring off the training step: the probe's optional asynchronous mode (``async_scoring=True``).

At a due step the training thread walks the layers and copies their factors (the stacks of
:func:`attn_probe.scoring.pairs.stack_layers`: stacked layers in the compute dtype, a layer scored
alone as a copy in its own dtype); a worker thread then scores the
copies, moves the values to the host and assembles the snapshot, which the training thread
hands to the sinks at its next probe call. Training never waits for the scoring, and the
scoring never reads weights that training is changing: it reads its own copies.

On CUDA the copies are made on a side stream that first waits for the training stream (so
they see the finished update), and the training stream then waits for the copies before its
next kernel (so the next update cannot overwrite weights still being copied); both are
device-side waits, no host synchronisation. The worker scores on the same side stream. On
CPU the copies are made on the training thread, at memory speed.

One snapshot is in flight at a time: a snapshot that comes due while the previous one is
still being scored is skipped and counted (:attr:`AsyncScorer.skipped`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["AsyncScorer", "DEFAULT_ASYNC_BYTES"]

#: largest copy an asynchronous snapshot may make (bytes); a larger one is scored synchronously
DEFAULT_ASYNC_BYTES = 2 << 30


class AsyncScorer:
    """Runs one scoring job at a time on a worker thread; its result is collected by :meth:`take`."""

    def __init__(self, max_bytes: int = DEFAULT_ASYNC_BYTES) -> None:
        self.max_bytes = max_bytes  # validated with the options (ProbeConfig.async_max_bytes)
        #: snapshots skipped because the previous one was still being scored
        self.skipped = 0
        self._thread: threading.Thread | None = None
        #: the running job's outcome, filled by its thread: ``[result, error]`` (one list per job,
        #: so that an abandoned job finishing late cannot overwrite a newer one's)
        self._outcome: list[Any] = []
        self._streams: dict[torch.device, Any] = {}

    # -- state -------------------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether a job is still running."""
        return self._thread is not None and self._thread.is_alive()

    def pending(self) -> bool:
        """Whether a job was submitted and its outcome not yet taken."""
        return self._thread is not None

    def take(self, wait: bool = False, timeout: float | None = None) -> tuple[bool, Any, BaseException | None]:
        """``(done, result, error)`` of the submitted job; ``wait`` joins it first (up to ``timeout``).

        A finished job is handed out once; ``done`` is ``False`` while it runs or when none was submitted.
        """
        thread, outcome = self._thread, self._outcome
        if thread is None:
            return False, None, None
        if wait:
            thread.join(timeout)
        if thread.is_alive():
            return False, None, None
        self._thread, self._outcome = None, []
        result, error = outcome if outcome else (None, RuntimeError("the scoring thread ended without a result"))
        return True, result, error

    def abandon(self) -> None:
        """Forget the running job: its outcome is never handed out (the thread ends on its own)."""
        self._thread, self._outcome = None, []

    # -- streams -----------------------------------------------------------------------------
    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    @contextlib.contextmanager
    def copying(self, devices: Iterable[torch.device]) -> Iterator[None]:
        """Context for making the copies (training thread): on CUDA, on the side stream, fenced.

        The side stream waits for the training stream before the copies; the training stream
        waits for the side stream after them. Elsewhere a plain context.
        """
        cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        if not cuda:
            yield
            return
        pairs = [(torch.cuda.current_stream(d), self._side_stream(d)) for d in cuda]
        for main, side in pairs:
            side.wait_stream(main)
        with contextlib.ExitStack() as stack:
            for _, side in pairs:
                stack.enter_context(torch.cuda.stream(side))
            yield
        for main, side in pairs:
            main.wait_stream(side)

    # -- running -----------------------------------------------------------------------------
    def submit(self, job: Callable[[], Any], devices: Iterable[torch.device] = ()) -> None:
        """Start ``job`` on a worker thread (on CUDA with the side streams current there)."""
        if self.busy() or self.pending():
            raise RuntimeError("an asynchronous snapshot is still pending")
        cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)

        outcome: list[Any] = []

        def run() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                with contextlib.ExitStack() as stack:
                    for d in cuda:
                        stack.enter_context(torch.cuda.stream(self._side_stream(d)))
                    result = job()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread by take()
                error = exc
            outcome.extend((result, error))

        self._outcome = outcome
        self._thread = threading.Thread(target=run, name="attn_probe-async-scoring", daemon=True)
        self._thread.start()
