"""Scoring models and saved checkpoints post hoc: the same core as the live probe.

- :mod:`.pairs`: the weight pairs a layer is scored on (query-key; value-output), and how each
  gathers its factors from a layer;
- :mod:`.model`: :func:`~attn_probe.scoring.model.score_model`, one row per layer (and head) of a
  model in memory;
- :mod:`.checkpoint`: :func:`~attn_probe.scoring.checkpoint.score_checkpoint`, a saved checkpoint
  read tensor by tensor (safetensors, ``.bin``, sharded indexes), and ``checkpoint-N`` directories;
- :mod:`.gguf`: GGUF files, read without llama.cpp.

``from attn_probe.scoring import score_model`` (the path from before 0.4 made this a package)
keeps working: the names of :mod:`.model` are served from here, on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["score_model"]


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name == "model":  # ``model`` not yet imported: not served from itself
        raise AttributeError(f"module 'attn_probe.scoring' has no attribute {name!r}")
    # not ``from . import model``: that asks this package for ``model`` first, which comes back here
    model = importlib.import_module(f"{__name__}.model")
    try:
        return getattr(model, name)
    except AttributeError:
        raise AttributeError(f"module 'attn_probe.scoring' has no attribute {name!r}") from None
