"""Helpers for the tracker-sink tests: a local MLflow server, readers of W&B's offline run file
and of trackio's SQLite store, and a tiny training loop with the probe attached.

Everything runs offline: the MLflow server listens on a free localhost port with a SQLite
store, W&B runs in offline mode, trackio writes to ``TRACKIO_DIR``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from helpers import tiny_model
from transformers import BertForMaskedLM

VOCAB, SEQ = 40, 10


# --------------------------------------------------------------------------- training
def tiny_bert(seed: int = 0, layers: int = 3, hidden: int = 32, heads: int = 4) -> BertForMaskedLM:
    return tiny_model("bert", seed, vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=2 * hidden, max_position_embeddings=SEQ)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, on_step: Any = None) -> None:
    """``steps`` optimizer updates on random tokens; ``on_step(i, loss)`` after each backward.

    ``on_step`` runs before ``opt.step()`` and may return a callable, which runs after it
    (so a user's logging can sit on both sides of the probe's snapshot).
    """
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        after = on_step(i, loss.item()) if on_step is not None else None
        opt.step()
        opt.zero_grad()
        if after is not None:
            after()


def probe_values(log_dir: str | Path) -> dict[tuple[int, str, str, int, int | None], float]:
    """``{(step, group, metric, layer, head): value}`` from the run's JSONL (``load_trajectory``)."""
    import pandas as pd

    import attn_probe

    df = attn_probe.load_trajectory(str(log_dir))
    out = {}
    for row in df.itertuples(index=False):
        head = None if pd.isna(row.head) else int(row.head)
        out[(int(row.step), str(row.group), str(row.metric), int(row.layer), head)] = float(row.value)
    return out


def expected_metrics(log_dir: str | Path, per_head: bool = False) -> dict[int, dict[str, float]]:
    """``{step: {tracker key: value}}`` a tracker sink should have sent, rebuilt from the JSONL.

    The across-layer stats are recomputed with :func:`attn_probe.formats.tags.layer_stats`.
    """
    from attn_probe.formats.tags import layer_stats
    from attn_probe.sinks.trackers import tracker_key

    out: dict[int, dict[str, float]] = {}
    by_metric: dict[tuple[int, str, str], list[float]] = {}
    for (step, group, metric, layer, head), value in probe_values(log_dir).items():
        if metric.startswith("random_"):  # the random-matrix range: the trajectory file only
            continue
        if head is None:
            by_metric.setdefault((step, group, metric), []).append(value)
        elif not per_head:
            continue
        out.setdefault(step, {})[tracker_key(group, metric, layer=layer, head=head)] = value
    for (step, group, metric), values in by_metric.items():
        every = layer_stats(values)
        for stat in _stats_of(metric):
            out[step][tracker_key(group, metric, stat=stat)] = every[stat]
    return out


def _stats_of(metric: str) -> tuple[str, ...]:
    """The across-layer stats the probe writes for ``metric``."""
    from attn_probe.formats import tags

    stats_for = getattr(tags, "stats_for", None)
    return tuple(stats_for(metric)) if stats_for is not None else tuple(tags.STATS)


# --------------------------------------------------------------------------- MLflow
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on a free localhost port with a SQLite store under ``root``."""

    def __init__(self, root: Path, timeout: float = 90.0) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "server.log"
        cmd = [sys.executable, "-m", "mlflow", "server",
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--default-artifact-root", str(self.root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root, env=env,
                                     start_new_session=True)
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the server's own process group (uvicorn workers)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=15)
        self._log.close()


# --------------------------------------------------------------------------- W&B offline file
#: LevelDB log format as W&B writes it: 32 KiB blocks; a 7-byte file header (":W&B", magic
#: 0xBEE1, version); each chunk has a 7-byte header (crc32c, length, type) and chunks of one
#: record are FULL, or FIRST + MIDDLE* + LAST; a block tail shorter than a header is padding.
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: str | Path) -> list[Any]:
    """Every ``wandb_internal_pb2.Record`` of an offline run file (``run-<id>.wandb``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            records.append(pb.Record.FromString(chunk))
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pb.Record.FromString(pending + chunk))
    return records


def finished_wandb_records(run_dir: str | Path, timeout: float = 60.0, run_id: str | None = None) -> list[Any]:
    """The records of the one offline run under ``run_dir`` (``run_id``: of that run), once its
    ``exit`` record is written.

    ``run.finish()`` can return before W&B's service process has written the end of the file
    (seen on a loaded machine), so this waits for the final ``exit`` record.
    """
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(p for p in Path(run_dir).rglob(f"run-{run_id or '*'}.wandb") if "latest-run" not in p.parts)
        if len(files) > 1:
            raise AssertionError(f"expected one .wandb file under {run_dir}, found {files}")
        try:
            records = wandb_records(files[0]) if files else []
        except Exception:  # noqa: BLE001 - a record still being written
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"no finished W&B run file under {run_dir} after {timeout:.0f} s: {files}")
        time.sleep(0.1)


def wandb_history(run_dir: str | Path, run_id: str | None = None) -> list[dict[str, Any]]:
    """The history rows of the one offline run under ``run_dir`` (``run_id``: of that run; each a
    ``{key: value}`` dict)."""
    rows = []
    for record in finished_wandb_records(run_dir, run_id=run_id):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def wandb_resumed_history(run_dir: str | Path, run_id: str, files: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The history rows of W&B run ``run_id`` from all its offline run files under ``run_dir``.

    Offline, each ``wandb.init`` of a resumed run writes a file of its own
    (``offline-run-<time>-<id>[-N]/run-<id>.wandb``); ``wandb sync`` merges them into the one run.
    Expects ``files`` files, each finished (its ``exit`` record written).
    """
    deadline = time.monotonic() + timeout
    while True:
        paths = sorted((p for p in Path(run_dir).rglob(f"run-{run_id}.wandb") if "latest-run" not in p.parts),
                       key=lambda p: (p.stat().st_mtime, str(p)))
        done = []
        for path in paths:
            try:
                records = wandb_records(path)
            except Exception:  # noqa: BLE001 - a record still being written
                records = []
            if records and records[-1].WhichOneof("record_type") == "exit":
                done.append(records)
        if len(paths) == files and len(done) == files:
            break
        if len(paths) > files:
            raise AssertionError(f"expected {files} .wandb files under {run_dir}, found {paths}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(done)} of {files} finished W&B run files under {run_dir} after "
                                 f"{timeout:.0f} s: {paths}")
        time.sleep(0.1)
    rows = []
    for records in done:
        for record in records:
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def wandb_metric_definitions(run_dir: str | Path) -> list[Any]:
    return [r.metric for r in finished_wandb_records(run_dir) if r.WhichOneof("record_type") == "metric"]


# --------------------------------------------------------------------------- trackio store
def trackio_rows(trackio_dir: str | Path, project: str) -> list[tuple[str, int, dict[str, Any]]]:
    """``(run_name, step, metrics)`` of every logged row of ``project`` in trackio's SQLite store."""
    db = Path(trackio_dir) / f"{project}.db"
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    return [(name, int(step), json.loads(metrics)) for name, step, metrics in rows]


# --------------------------------------------------------------------------- isolation between tests
def wandb_offline_env(monkeypatch: Any, tmp_path: Path, **extra: str) -> Any:
    """Offline W&B in ``tmp_path/wb`` for one test: a generator for a pytest fixture.

    ``wandb.teardown()`` before and after: W&B keeps a process-wide singleton whose settings
    (``WANDB_DIR`` among them) are read once, so without it a later test's run is written into
    an earlier test's directory.
    """
    import pytest

    pytest.importorskip("wandb")
    import wandb

    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
           "WANDB_DIR": str(tmp_path / "wb"), "WANDB_DISABLE_GIT": "true",
           "WANDB_DISABLE_CODE": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wbconfig"),
           "WANDB_CACHE_DIR": str(tmp_path / "wbcache"), **extra}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "wb").mkdir()
    yield tmp_path / "wb"
    if wandb.run is not None:  # a failed test must not leave a run behind for the next one
        wandb.run.finish()
    wandb.teardown()


def use_mlflow_server(monkeypatch: Any, uri: str) -> None:
    """Point MLflow at ``uri`` for one test: the environment *and* the process-wide URI.

    ``mlflow.set_tracking_uri`` outranks ``MLFLOW_TRACKING_URI`` and outlives the test: every
    MLflow test calls this, so none inherits a URI of a server that is gone.
    """
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow.set_tracking_uri(uri)


def child_pids(pid: int, name: str) -> list[int]:
    """The child processes of ``pid`` whose command line contains ``name`` (Linux ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and name in cmdline:
            found.append(int(entry))
    return found
