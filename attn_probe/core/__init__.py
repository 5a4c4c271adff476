"""The one scoring core: a layer's factors -> a ``(metrics, 1 + H)`` tensor on the weights' device.

Every path that scores weights goes through :func:`score_factors`: the live probe (through
its pairs, :mod:`attn_probe.scoring.pairs`), :func:`attn_probe.score_model`, checkpoint scoring and
the distributed path. So on the same weights, device and dtype they give the same numbers.

For factors ``A_h, B_g`` (per-head ``(head_dim, d)`` slices; query head ``h`` reads key head
``g(h) = h // (H / H_kv)``) the scored matrices are ``M_h = A_h^T B_{g(h)}`` and the layer
matrix ``M = sum_h M_h``. Column 0 of the result is ``M``, column ``1 + h`` is ``M_h``.

**Adding a metric** touches :mod:`attn_probe.core.formulas` only: write a function ``(products) -> (n, G)``
tensor and add it to :data:`METRICS` (and to :data:`MAGNITUDES` if it is an unbounded
magnitude rather than a score in ``[-1, 1]``: TensorBoard then also gets its across-layer
``max`` and plots draw it on a log axis). It can use the shared quantities of :class:`Products`
(computed lazily, once per batch, from the factors without forming ``d x d`` when they are
thin) or add a new cached property there (:mod:`attn_probe.core.products`). The metric name is the JSONL ``metric`` field,
the TensorBoard tag segment and the row key, unchanged everywhere.

No host transfer happens here: results stay on the factors' device until a caller moves
many layers' tables to the host in one transfer. :func:`score_factor_stack` scores many layers
of one shape at once (the live probe's path). The algorithm is chosen per device in one place,
:func:`gpu_algorithm`:

* **GPU algorithm** (every device but CPU; on CPU tensors under :func:`gpu_algorithm_on_cpu`
  or ``ATTN_PROBE_GPU_ALGORITHM=1``): every largest-eigenvalue problem of a stack
  (``sigma_max`` of ``M``, of the query and of the key factors, per head too) is registered
  with one :class:`Spectra` and solved by batched repeated squaring
  (:func:`lambda_max_by_squaring`, at most about ``ln(m) / 2^20`` relative below
  ``lambda_max``), one chain per problem size: a fixed number of operations per stack,
  whatever the numbers of layers and heads; matrix products only, so nothing waits for the
  device and no dense eigensolver runs.
* **CPU algorithm**: LAPACK ``eigh``/``eigvalsh`` for problems up to
  :func:`lanczos_threshold`, a fixed-step Lanczos iteration above it (faster on CPU).

The package, by job: :mod:`~attn_probe.core.algorithm` (the algorithm choices),
:mod:`~attn_probe.core.spectra` (largest eigenvalues: squaring chains, ``Spectra``, LAPACK,
Lanczos), :mod:`~attn_probe.core.products` (validation, rescaling, ``Products``),
:mod:`~attn_probe.core.formulas` (the metrics and their registry), :mod:`~attn_probe.core.stacks`
(the entry points and tables). It shares no code with the independent reference definitions,
:mod:`attn_probe.definitions`, that the tests compare it with.
"""

from __future__ import annotations

from .algorithm import (
    EXPLICIT_PASS_COST,
    GPU_ALGORITHM_ENV,
    gpu_algorithm,
    gpu_algorithm_on_cpu,
    gram_is_cheaper,
    gram_out_dtype_supported,
    host_eigensolver,
    lanczos_threshold,
)
from .formulas import (
    DEFAULT_METRICS,
    MAGNITUDES,
    METRICS,
    WRITTEN_NAMES,
    check_metrics,
    is_magnitude,
)
from .products import (
    Products,
)
from .spectra import (
    CHAIN_DTYPE,
    CPU_MV_ENTRIES,
    LANCZOS_STEPS,
    PAD_FREE_WORK,
    SQUARINGS,
    Spectra,
    lambda_max_by_squaring,
    lanczos_lambda_max,
    lanczos_steps,
    renormalise_every,
)
from .stacks import (
    FactoredScores,
    factored_scores,
    score_factor_stack,
    score_factors,
    table_entries,
    table_rows,
)

__all__ = [
    "METRICS",
    "DEFAULT_METRICS",
    "MAGNITUDES",
    "WRITTEN_NAMES",
    "is_magnitude",
    "Products",
    "check_metrics",
    "score_factors",
    "score_factor_stack",
    "factored_scores",
    "FactoredScores",
    "gpu_algorithm",
    "gpu_algorithm_on_cpu",
    "lambda_max_by_squaring",
    "Spectra",
    "table_entries",
    "table_rows",
    "GPU_ALGORITHM_ENV",
    "EXPLICIT_PASS_COST",
    "host_eigensolver",
    "lanczos_threshold",
    "gram_out_dtype_supported",
    "gram_is_cheaper",
    "SQUARINGS",
    "CHAIN_DTYPE",
    "PAD_FREE_WORK",
    "LANCZOS_STEPS",
    "CPU_MV_ENTRIES",
    "renormalise_every",
    "lanczos_steps",
    "lanczos_lambda_max",
]
