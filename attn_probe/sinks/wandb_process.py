"""The probe's own W&B run, written by a child Python process of its own (issue 44).

A W&B run started in the training process joins that process's W&B state whatever its
``reinit``: ``wandb.init(reinit="create_new")`` leaves ``wandb.run`` alone, but the run still
becomes W&B's *most recent active run*, which a plain ``wandb.init()`` of the user's returns
(W&B's default ``reinit="return_previous"``), ``reinit="finish_previous"`` finishes, and a
``mode="disabled"`` run always becomes ``wandb.run``. W&B's public API has no way to start a
second run in a process that stays out of them. So every run the probe creates lives in a child
process (the way W&B documents for runs in several processes): :class:`ChildRun` is its handle
in the training process, with the few methods the sink calls (``log``, ``define_metric``,
``config.update``, ``summary.get``, ``finish``); each is one request and one reply over the
child's pipes, made on the sink's lane only. The child inherits the environment, so it finds
the user's W&B service (``WANDB_SERVICE``), credentials and settings; it ends its run and exits
when it is told to or when the training process is gone (end of input).

Run with ``python -m attn_probe.sinks.wandb_process`` by :class:`ChildRun` only.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from typing import Any, BinaryIO

__all__ = ["ChildRun"]

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
    """A W&B run created with ``wandb.init(**init_kwargs)`` in a child process: never one of the
    training process's W&B runs. Blocks until the child answers (call it off the training thread);
    a W&B error in the child is raised here as ``RuntimeError`` naming it."""

    def __init__(self, init_kwargs: dict[str, Any]) -> None:
        self._proc: subprocess.Popen | None = None
        try:
            payload = pickle.dumps(dict(init_kwargs))
        except Exception as exc:  # noqa: BLE001 - named in the error below
            raise TypeError(f"the W&B run's settings cannot be sent to its process ({type(exc).__name__}: {exc})") from None
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([here, *(p for p in sys.path if p)]))
        env.setdefault("WANDB_CONSOLE", "off")  # nothing of the child's to capture
        self._proc = subprocess.Popen([sys.executable, "-m", "attn_probe.sinks.wandb_process"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        info = self.call("init", **pickle.loads(payload))
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
        return self._proc.pid if self._proc is not None else None

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"the probe's W&B process has ended (exit code {proc.returncode if proc else None})")
        try:
            _write(proc.stdin, (op, args, kwargs))
            reply = _read(proc.stdout)
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

    def log(self, values: dict[str, Any], commit: bool | None = None) -> None:
        self.call("log", values, commit=commit)

    def define_metric(self, name: str, **kwargs: Any) -> None:
        self.call("define_metric", name, **kwargs)

    def finish(self, exit_code: int | None = None) -> None:
        """Finish the run and end the child (at once if it no longer answers)."""
        proc, error = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                self.call("finish", exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001 - raised after the child is ended
            error = exc
        finally:
            self._proc = None
            _end(proc)
        if error is not None:
            raise error


def _end(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except Exception:  # noqa: BLE001
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------ the child
def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    run, finished = None, False
    try:
        while not finished:
            message = _read(requests)
            if message is None:  # the training process is gone
                break
            op, args, kwargs = message
            try:
                result = None
                if op == "init":
                    import wandb

                    run = wandb.init(**kwargs)
                    result = {"id": run.id, "name": run.name, "project": run.project,
                              "entity": getattr(run, "entity", None), "group": getattr(run, "group", None),
                              "mode": getattr(run.settings, "mode", None)}
                elif op == "log":
                    run.log(*args, **kwargs)
                elif op == "define_metric":
                    run.define_metric(*args, **kwargs)
                elif op == "config_update":
                    run.config.update(*args, **kwargs)
                elif op == "summary_get":
                    result = _plain(run.summary.get(*args))
                elif op == "finish":
                    finished = True
                    run, done = None, run
                    if done is not None:
                        done.finish(**kwargs)
                else:
                    raise ValueError(f"unknown request {op!r}")
                reply = ("ok", result)
            except BaseException as exc:  # noqa: BLE001 - told to the training process
                reply = ("error", f"{type(exc).__name__}: {exc}")
            _write(replies, reply)
    finally:
        if run is not None:  # the training process ended without finishing the run
            run.finish(exit_code=1)


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed in the child goes to stderr, never into the replies
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
