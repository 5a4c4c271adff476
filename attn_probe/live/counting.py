"""Step counting: what advances the probe's counter in each kind of training loop.

* :class:`OptimizerUpdates`: a step post-hook counts ``optimizer.step()`` calls (plain loops,
  and the inner optimizer of an Accelerate-prepared one, which is called only on real updates);
* :class:`ForwardPasses`: a forward pre-hook on the root module counts *training-mode forward
  passes* (micro-batches under gradient accumulation), when no optimizer is given;
* :class:`EngineSteps`: a DeepSpeed engine's applied updates (Accelerate with DeepSpeed);
* the Trainer callback passes ``state.global_step`` (optimizer updates) itself.

Each counter calls ``probe.on_update(step=None)`` and has ``remove()``; the probe keeps it
as a hook handle and removes it at ``close()``. The hooks on the model and the optimizer are
:class:`~attn_probe.hooks.ProbeHook` s: a watched model or optimizer can be pickled, saved
whole and deep-copied, and a copy's forwards never advance the probe.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch import nn

from ..hooks import ProbeHook

__all__ = ["OptimizerUpdates", "ForwardPasses", "EngineSteps"]


class Counted(Protocol):
    step: int

    def on_update(self, step: int | None = None) -> None: ...


class OptimizerUpdates:
    """Count ``optimizer.step()`` calls with a step post-hook."""

    def __init__(self, optimizer: torch.optim.Optimizer, probe: Counted) -> None:
        if not hasattr(optimizer, "register_step_post_hook"):
            raise TypeError(f"{type(optimizer).__name__} has no register_step_post_hook; pass a torch optimizer")
        self.probe = probe
        self._handle = optimizer.register_step_post_hook(ProbeHook(self._after_step))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.probe.on_update()

    def remove(self) -> None:
        self._handle.remove()


class ForwardPasses:
    """Count training-mode forward passes of ``module`` (micro-batches under accumulation).

    The step of a forward is the number of forwards before it: the weights it sees.
    ``final_step`` is the count after the last forward (the step of the weights left).
    """

    def __init__(self, module: nn.Module, probe: Counted) -> None:
        self.probe = probe
        self.base = probe.step
        self.count = 0
        self.final_step: int | None = None
        self._handle = module.register_forward_pre_hook(ProbeHook(self._before_forward))

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self.probe.on_update(self.base + self.count)
            self.count += 1
            self.final_step = self.base + self.count

    def remove(self) -> None:
        self._handle.remove()


class EngineSteps:
    """Wrap a DeepSpeed engine's ``step`` (instance attribute) to count applied updates."""

    def __init__(self, engine: Any, probe: Counted) -> None:
        self.engine = engine
        self.original = engine.step

        @functools.wraps(self.original)
        def step(*args: Any, **kwargs: Any) -> Any:
            before = getattr(engine, "global_steps", None)
            out = self.original(*args, **kwargs)
            after = getattr(engine, "global_steps", None)
            applied = engine.was_step_applied() if hasattr(engine, "was_step_applied") else True
            if after != before and applied:
                probe.on_update()
            return out

        engine.step = step

    def remove(self) -> None:
        self.engine.step = self.original
