"""attn_probe: watch the query-key matrix W_qk = W_q W_k^T become symmetric or directional.

Scores after Saponati et al., *The underlying structures of self-attention* (ICML 2025).
Importing this package loads nothing heavy (not even torch): every public name is served
lazily, and torch, transformers, accelerate, pandas and matplotlib are imported by the modules
that need them, so reading and exporting trajectories never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover  (for type checkers and editors; at run time the names are lazy)
    from .analysis.export import export_trajectory
    from .analysis.loading import load_trajectory, read_table
    from .analysis.plots import plot_dynamics, plot_heatmap
    from .analysis.summary import layer_quantiles, summarize
    from .core import factored_scores, score_factors
    from .definitions import directionality_score, symmetry_score
    from .extraction import (
        AttentionLayer,
        UnsupportedModelError,
        find_attention,
        register_adapter,
        unregister_adapter,
    )
    from .integrations.transformers import AttnProbeCallback, attach
    from .intervention import symmetric_init_
    from .live.alerts import Alert, AlertRule
    from .live.config import ProbeConfig
    from .live.probe import LogDirError, Probe
    from .live.schedules import every, log_spaced
    from .scoring.checkpoint import CheckpointError, score_checkpoint
    from .scoring.model import score_model
    from .watching import watch

__version__ = "0.4.0"  # the one place the version is written: setup.cfg reads it (attr:)


# Names served lazily so that `import attn_probe` stays light.
_LAZY = {
    "AttentionLayer": ("attn_probe.extraction", "AttentionLayer"),
    "UnsupportedModelError": ("attn_probe.extraction", "UnsupportedModelError"),
    "find_attention": ("attn_probe.extraction", "find_attention"),
    "register_adapter": ("attn_probe.extraction", "register_adapter"),
    "unregister_adapter": ("attn_probe.extraction", "unregister_adapter"),
    "factored_scores": ("attn_probe.core", "factored_scores"),
    "directionality_score": ("attn_probe.definitions", "directionality_score"),
    "symmetry_score": ("attn_probe.definitions", "symmetry_score"),
    "score_model": ("attn_probe.scoring.model", "score_model"),
    "AttnProbeCallback": ("attn_probe.integrations.transformers", "AttnProbeCallback"),
    "attach": ("attn_probe.integrations.transformers", "attach"),
    "watch": ("attn_probe.watching", "watch"),
    "ProbeConfig": ("attn_probe.live.config", "ProbeConfig"),
    "score_factors": ("attn_probe.core", "score_factors"),
    "Probe": ("attn_probe.live.probe", "Probe"),
    "every": ("attn_probe.live.schedules", "every"),
    "log_spaced": ("attn_probe.live.schedules", "log_spaced"),
    "load_trajectory": ("attn_probe.analysis.loading", "load_trajectory"),
    "export_trajectory": ("attn_probe.analysis.export", "export_trajectory"),
    "summarize": ("attn_probe.analysis.summary", "summarize"),
    "plot_dynamics": ("attn_probe.analysis.plots", "plot_dynamics"),
    "plot_heatmap": ("attn_probe.analysis.plots", "plot_heatmap"),
    "score_checkpoint": ("attn_probe.scoring.checkpoint", "score_checkpoint"),
    "CheckpointError": ("attn_probe.scoring.checkpoint", "CheckpointError"),
    "LogDirError": ("attn_probe.live.probe", "LogDirError"),
    "read_table": ("attn_probe.analysis.loading", "read_table"),
    "layer_quantiles": ("attn_probe.analysis.summary", "layer_quantiles"),
    "symmetric_init_": ("attn_probe.intervention", "symmetric_init_"),
    "AlertRule": ("attn_probe.live.alerts", "AlertRule"),
    "Alert": ("attn_probe.live.alerts", "Alert"),
}

#: what ``from attn_probe import *`` gives: every lazily served public name, and the version
#: (tests/commands/test_smoke.py keeps the two lists equal). A star import resolves each name, so it
#: loads torch; a plain ``import attn_probe`` does not.
__all__ = [
    "AttentionLayer",
    "UnsupportedModelError",
    "find_attention",
    "register_adapter",
    "unregister_adapter",
    "factored_scores",
    "directionality_score",
    "symmetry_score",
    "score_model",
    "AttnProbeCallback",
    "attach",
    "watch",
    "ProbeConfig",
    "score_factors",
    "Probe",
    "every",
    "log_spaced",
    "load_trajectory",
    "export_trajectory",
    "summarize",
    "plot_dynamics",
    "plot_heatmap",
    "score_checkpoint",
    "CheckpointError",
    "LogDirError",
    "read_table",
    "layer_quantiles",
    "symmetric_init_",
    "AlertRule",
    "Alert",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    if not name.startswith(
        "_"
    ):  # `attn_probe.core` after a bare `import attn_probe`, as before names were lazy
        import importlib.util

        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'attn_probe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_LAZY))
