"""Fixtures shared by several test files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the shared modules (helpers, tracker_servers, distributed_workers/) live here, beside the test
# folders that mirror the package (tests/core/, tests/demo/, ...): importable from every folder
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's process-wide state reset before and after a test that builds an Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One local MLflow tracking server (SQLite store, free localhost port) for the whole session.

    Tests keep apart by experiment names and run ids of their own; each points MLflow at it with
    ``tracker_servers.use_mlflow_server``.
    """
    pytest.importorskip("mlflow")
    from tracker_servers import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()
