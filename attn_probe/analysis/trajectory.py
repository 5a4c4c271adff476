"""Read probe runs back as one long table, and export it.

A *run directory* is a directory that holds the lossless trajectory file ``attn_probe.jsonl``
(see :mod:`attn_probe.formats.trajectory`) or TensorBoard event files. The trajectory file is
preferred; event files are read only when it is missing (or holds nothing usable), with no
down-sampling, and their across-layer aggregate tags (``median``/``q25``/``q75``) are ignored
because :func:`attn_probe.analysis.summary.layer_quantiles` recomputes them.

The table is long: one row per value, columns ``run, group, step, layer, head, metric,
value``; ``layer`` and ``head`` are nullable ``Int64`` and ``head`` is ``<NA>`` on rows of the
layer-level matrix ``M = sum_h W_q^h W_k^h^T``. Event files store float32, the trajectory file
float64.

pandas (and pyarrow for Parquet) are optional: ``pip install attn-probe[pandas]``.

This module is the stable import path of the readers' public names; the code lives by job in
:mod:`~attn_probe.analysis.runs` (run discovery), :mod:`~attn_probe.analysis.reading` (files
into rows), :mod:`~attn_probe.analysis.loading` (the long table), :mod:`~attn_probe.analysis.export`
and :mod:`~attn_probe.analysis.table` (columns, errors, normalisation).
"""


from __future__ import annotations

# re-exports: ``__all__`` below, and (noqa) the other names this module held before the split
from ..formats.events import scan_event_file  # noqa: F401
from .export import check_output_path, export_trajectory
from .loading import (
    as_frame,  # noqa: F401
    load_trajectory,
    read_table,
)
from .runs import MAX_DEPTH, NamedRun, find_runs, parse_run_argument, trainer_output_dir  # noqa: F401
from .table import (  # noqa: F401
    COLUMNS,
    FORMATS,
    FORMULA_START,
    LINEAGE,
    RENAMED_METRICS,
    MissingExtraError,
    PathLike,
    RunsLike,
    TrajectoryError,
    TrajectoryWarning,
    escape_formulas,
    normalize,
    require,
    resolve_format,
    unescape_formulas,
)

__all__ = [
    "COLUMNS",
    "LINEAGE",
    "FORMATS",
    "MissingExtraError",
    "TrajectoryError",
    "TrajectoryWarning",
    "export_trajectory",
    "NamedRun",
    "find_runs",
    "load_trajectory",
    "read_table",
    "RENAMED_METRICS",
    "check_output_path",
    "escape_formulas",
    "unescape_formulas",
]
