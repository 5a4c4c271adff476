"""The probe's own W&B run, written by a child Python process of its own (issue 44).

A W&B run started in the training process joins that process's W&B state whatever its
``reinit``: ``wandb.init(reinit="create_new")`` leaves ``wandb.run`` alone, but the run still
becomes W&B's *most recent active run*, which a plain ``wandb.init()`` of the user's returns
(W&B's default ``reinit="return_previous"``), ``reinit="finish_previous"`` finishes, and a
``mode="disabled"`` run always becomes ``wandb.run``. W&B's public API has no way to start a
second run in a process that stays out of them. So every run the probe creates lives in a child
process (the way W&B documents for runs in several processes): one child per training process,
shared by the probe's runs (side by side there with ``reinit="create_new"``), started at the first
and ended when the last is finished. :class:`ChildRun` is a run's handle in the training process,
with the few methods the sink calls (``log``, ``define_metric``, ``config.update``,
``summary.get``, ``finish``); each is one request and one reply over the child's pipes, made on a
sink's lane only. The child inherits the environment, so it finds the user's W&B service
(``WANDB_SERVICE``), credentials and settings; it finishes its runs (``exit_code=1``) and exits
when the training process is gone (end of input).

Run with ``python -m attn_probe.sinks.wandb_process`` by :class:`ChildRun` only.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

__all__ = ["ChildRun", "Reservation", "reserve"]

_LENGTH = struct.Struct("<Q")


def _write(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read(stream: BinaryIO) -> Any:
    """One message, or ``None`` at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


class _Process:
    """The child process hosting the probe's runs: one at a time per training process, shared by
    every run the probe creates, ended when the last of them is finished. One request and its reply
    at a time (a lock taken by the sinks' lanes only, never by a thread of the user's)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([here, *(p for p in sys.path if p)]))
        env.setdefault("WANDB_CONSOLE", "off")  # nothing of the child's to capture
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attn_probe.sinks.wandb_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self.lock = threading.Lock()
        self.runs = 0
        self.next_handle = 0

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def call(self, op: str, handle: int, args: tuple, kwargs: dict[str, Any]) -> Any:
        with self.lock:
            if self.ended():
                raise RuntimeError(f"the probe's W&B process has ended (exit code {self.proc.returncode})")
            try:
                _write(self.proc.stdin, (op, handle, args, kwargs))
                reply = _read(self.proc.stdout)
            except (OSError, ValueError) as exc:
                reply, why = None, f" ({type(exc).__name__}: {exc})"
            else:
                why = ""
        if reply is None:
            raise RuntimeError(f"the probe's W&B process ended during {op}{why}")
        status, value = reply
        if status != "ok":
            raise RuntimeError(f"W&B {op} in the probe's process failed: {value}")
        return value

    def end(self) -> None:
        """End the child: told so (a forked process of the user's, a DataLoader worker, may hold its
        input open, so the end of input alone would not reach it), then its pipes closed."""
        with self.lock:
            try:
                _write(self.proc.stdin, ("exit", 0, (), {}))
            except (OSError, ValueError):
                pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except Exception:  # noqa: BLE001
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


_SHARED: _Process | None = None
_SHARED_LOCK = threading.Lock()


class Reservation:
    """A place for one run in the shared child process, taken ahead of the run (:func:`reserve`):
    the child starts importing W&B at once, and :class:`ChildRun` finds it ready."""

    def __init__(self, process: _Process, handle: int) -> None:
        self.process, self.handle = process, handle
        self._released = False

    def release(self) -> None:
        """Give the place back (once; the last place of the child ends it)."""
        global _SHARED
        with _SHARED_LOCK:
            if self._released:
                return
            self._released = True
            self.process.runs -= 1
            last = self.process.runs <= 0
            if last and _SHARED is self.process:
                _SHARED = None
        if last:
            self.process.end()


def reserve() -> Reservation:
    """A place for one more run in the shared child process, started here if none runs (in the
    environment of this moment)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED.ended():
            _SHARED = _Process()
        _SHARED.runs += 1
        _SHARED.next_handle += 1
        return Reservation(_SHARED, _SHARED.next_handle)


class _Config:
    def __init__(self, run: ChildRun) -> None:
        self._run = run

    def update(self, values: dict[str, Any], allow_val_change: bool = False) -> None:
        self._run.call("config_update", values, allow_val_change=allow_val_change)


class _Summary:
    def __init__(self, run: ChildRun) -> None:
        self._run = run

    def get(self, key: str, default: Any = None) -> Any:
        return self._run.call("summary_get", key, default)


class _Settings:
    def __init__(self, mode: str | None) -> None:
        self.mode = mode


class ChildRun:
    """A W&B run created with ``wandb.init(**init_kwargs)`` in the child process: never one of the
    training process's W&B runs. Blocks until the child answers (call it off the training thread);
    a W&B error in the child is raised here as ``RuntimeError`` naming it."""

    def __init__(self, init_kwargs: dict[str, Any], reservation: Reservation | None = None) -> None:
        try:
            payload = pickle.loads(pickle.dumps(dict(init_kwargs)))
        except Exception as exc:  # noqa: BLE001 - named in the error below
            if reservation is not None:
                reservation.release()
            raise TypeError(
                f"the W&B run's settings cannot be sent to its process ({type(exc).__name__}: {exc})"
            ) from None
        self._place: Reservation | None = reservation if reservation is not None else reserve()
        try:
            info = self.call("init", **payload)
        except BaseException:
            place, self._place = self._place, None
            place.release()
            raise
        self.id: str = info["id"]
        self.name: str | None = info["name"]
        self.project: str | None = info["project"]
        self.entity: str | None = info["entity"]
        self.group: str | None = info["group"]
        self.settings = _Settings(info["mode"])
        self.offline = info["mode"] in ("offline", "dryrun")
        self.config = _Config(self)
        self.summary = _Summary(self)

    @property
    def pid(self) -> int | None:
        """The child process's id (while the run is open)."""
        return self._place.process.proc.pid if self._place is not None else None

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        place = self._place
        if place is None:
            raise RuntimeError("the probe's W&B run is finished")
        return place.process.call(op, place.handle, args, kwargs)

    def log(self, values: dict[str, Any], commit: bool | None = None) -> None:
        self.call("log", values, commit=commit)

    def define_metric(self, name: str, **kwargs: Any) -> None:
        self.call("define_metric", name, **kwargs)

    def finish(self, exit_code: int | None = None) -> None:
        """Finish the run (the last run of the child ends the child, at once if it no longer answers)."""
        if self._place is None:
            return
        try:
            self.call("finish", exit_code=exit_code)
        finally:
            place, self._place = self._place, None
            place.release()


# ------------------------------------------------------------------------------------ the child
def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    runs: dict[int, Any] = {}
    try:
        while True:
            message = _read(requests)
            if message is None:  # the training process is gone, or its last run is finished
                break
            op, handle, args, kwargs = message
            if op == "exit":
                break
            try:
                result = None
                if op == "init":
                    import wandb

                    # several runs of the probe's side by side in this process; its globals serve no one
                    run = runs[handle] = wandb.init(**{**kwargs, "reinit": "create_new"})
                    result = {
                        "id": run.id,
                        "name": run.name,
                        "project": run.project,
                        "entity": getattr(run, "entity", None),
                        "group": getattr(run, "group", None),
                        "mode": getattr(run.settings, "mode", None),
                    }
                elif op == "finish":
                    runs.pop(handle).finish(**kwargs)
                else:
                    run = runs[handle]
                    if op == "log":
                        run.log(*args, **kwargs)
                    elif op == "define_metric":
                        run.define_metric(*args, **kwargs)
                    elif op == "config_update":
                        run.config.update(*args, **kwargs)
                    elif op == "summary_get":
                        result = _plain(run.summary.get(*args))
                    else:
                        raise ValueError(f"unknown request {op!r}")
                reply = ("ok", result)
            except BaseException as exc:  # noqa: BLE001 - told to the training process
                reply = ("error", f"{type(exc).__name__}: {exc}")
            _write(replies, reply)
    finally:
        for run in runs.values():  # the training process ended without finishing them
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001
                pass


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed in the child goes to stderr, never into the replies
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
