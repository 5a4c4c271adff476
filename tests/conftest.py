"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's process-wide state reset before and after a test that builds an Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
