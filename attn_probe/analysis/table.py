"""The long table of probe values: its columns, the errors and warnings of reading runs back,
optional extras, column normalisation and the export formats' names.

The table is long: one row per value, columns ``run, group, step, layer, head, metric,
value``; ``layer`` and ``head`` are nullable ``Int64`` and ``head`` is ``<NA>`` on rows of the
layer-level matrix ``M = sum_h W_q^h W_k^h^T``. Shared by run discovery
(:mod:`~attn_probe.analysis.runs`), reading (:mod:`~attn_probe.analysis.reading`), loading
(:mod:`~attn_probe.analysis.loading`) and export (:mod:`~attn_probe.analysis.export`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


PathLike = str | os.PathLike
#: what the loaders accept: one path, several, or ``{run name: path}``
RunsLike = PathLike | Sequence[PathLike] | Mapping[str, PathLike]

COLUMNS = ("run", "group", "step", "layer", "head", "metric", "value")
#: lineage columns, present when a loaded run has a run header: its id, its parent's id and step
LINEAGE = ("run_id", "parent_run", "parent_step")
#: export format -> file name suffixes that select it
FORMATS: dict[str, tuple[str, ...]] = {
    "csv": (".csv",),
    "parquet": (".parquet", ".pq"),
    "jsonl": (".jsonl", ".ndjson"),
}
ROW_KEY = ["run", "group", "metric", "layer", "head", "step"]
#: metric names written by earlier versions -> their names now; every loader renames on read
RENAMED_METRICS: dict[str, str] = {"ov_qk_bound": "ov_gain_bound"}
#: first characters that make a spreadsheet read a CSV cell as a formula (or smuggle one in)
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


class TrajectoryError(ValueError):
    """No usable probe data where some was expected (the message says where and why)."""


class TrajectoryWarning(UserWarning):
    """Something was skipped while reading (corrupt lines, directories without probe data)."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str) -> Any:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``attn-probe[extra]``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{module} is needed for this: pip install 'attn-probe[{extra}]'"
        ) from exc


def require_pandas() -> Any:
    return require("pandas", "pandas")


#: the range of the table's int64/Int64 columns
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_int64(v: Any) -> bool:
    """An ``int`` (not ``bool``) that fits the table's int64/Int64 columns."""
    return _is_int(v) and _INT64_MIN <= v <= _INT64_MAX


def is_text(v: Any) -> bool:
    """A ``str`` that can be written back as UTF-8 (no lone surrogates)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_na(v: Any) -> bool:
    """A scalar missing value (``None``, NaN, ``pd.NA``); never an error for other objects."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return True
    try:
        import pandas as pd

        return v is pd.NA or v is pd.NaT or (hasattr(v, "dtype") and getattr(v, "ndim", 1) == 0
                                              and bool(pd.isna(v)))
    except Exception:  # noqa: BLE001
        return False


def _as_int64(v: Any) -> int | None:
    """``v`` as an int within int64, or ``None`` (also for fractions, inf, text, containers)."""
    if isinstance(v, bool):
        return None
    try:
        if isinstance(v, str):
            v = v.strip()
            try:
                v = int(v)
            except ValueError:
                v = float(v)
        elif hasattr(v, "dtype") and getattr(v, "ndim", 1) == 0:  # numpy scalar
            v = v.item()
        if isinstance(v, float):
            if not math.isfinite(v) or v != math.floor(v):
                return None
            v = int(v)
    except (ValueError, TypeError, OverflowError):
        return None
    return v if is_int64(v) else None


def _int_column(s: pd.Series, nullable: bool) -> tuple[Any, Any]:
    """``(Int64 values, bad-row mask)``: rows that are not integers within int64 are bad
    (and missing ones too unless ``nullable``). Fast paths for integer and float columns."""
    import numpy as np

    pd = require_pandas()
    n = len(s)
    if pd.api.types.is_integer_dtype(s.dtype) and not pd.api.types.is_unsigned_integer_dtype(s.dtype):
        out = s.astype("Int64")
        na = out.isna().to_numpy()
        return out, (np.zeros(n, dtype=bool) if nullable else na)
    if pd.api.types.is_float_dtype(s.dtype):
        f = s.to_numpy(dtype="float64", na_value=np.nan)
        na = np.isnan(f)
        with np.errstate(invalid="ignore"):
            good = np.isfinite(f) & (f == np.trunc(f)) & (f >= -(2.0**63)) & (f < 2.0**63)
        vals = np.where(good, f, 0.0).astype(np.int64)
    else:  # object, strings, unsigned, bool: one by one
        vals = np.zeros(n, dtype=np.int64)
        good = np.zeros(n, dtype=bool)
        na = np.zeros(n, dtype=bool)
        for i, v in enumerate(s.tolist()):
            if is_na(v):
                na[i] = True
                continue
            iv = _as_int64(v)
            if iv is not None:
                vals[i], good[i] = iv, True
    bad = ~good & ~na if nullable else ~good
    return pd.Series(pd.arrays.IntegerArray(vals, ~good), index=s.index), bad


def _float_column(s: pd.Series) -> tuple[Any, Any]:
    """``(float64 values, bad-row mask)``: missing is NaN; text, bools, containers are bad."""
    import numpy as np

    pd = require_pandas()
    if (pd.api.types.is_float_dtype(s.dtype) or pd.api.types.is_integer_dtype(s.dtype)) and \
            not pd.api.types.is_bool_dtype(s.dtype):
        return s.to_numpy(dtype="float64", na_value=np.nan), np.zeros(len(s), dtype=bool)
    vals = np.full(len(s), np.nan)
    bad = np.zeros(len(s), dtype=bool)
    for i, v in enumerate(s.tolist()):
        if is_na(v):
            continue
        try:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)) and not hasattr(v, "dtype"):
                raise TypeError
            vals[i] = float(v)
        except (ValueError, TypeError, OverflowError):
            bad[i] = True
    return vals, bad


def _str_column(s: pd.Series) -> tuple[Any, Any]:
    """``(str values, bad-row mask)``: text that cannot be written as UTF-8 (lone surrogates) is bad."""
    import numpy as np

    out = s.astype(str)
    unique = out.unique().tolist()
    try:  # all of them at once: one encode (a lone surrogate fails it)
        "".join(unique).encode("utf-8")
        wrong: list[str] = []
    except UnicodeEncodeError:
        wrong = [v for v in unique if not is_text(v)]
    return out, (out.isin(wrong).to_numpy() if wrong else np.zeros(len(s), dtype=bool))


def _optional_text_column(s: pd.Series) -> tuple[Any, Any]:
    """``(object values, bad-row mask)`` of a nullable text column: missing is ``None``; text
    that cannot be written as UTF-8, or a non-text value, is bad."""
    import numpy as np

    values = s.to_numpy(dtype=object, na_value=None)
    out = np.empty(len(values), dtype=object)
    bad = np.zeros(len(values), dtype=bool)
    cache: dict[Any, bool] = {}
    for i, v in enumerate(values):
        if isinstance(v, str):
            ok = cache.get(v)
            if ok is None:
                ok = cache[v] = is_text(v)
            if ok:
                out[i] = v
                continue
        elif v is None or is_na(v):
            continue
        bad[i] = True
    return out, bad


def normalize(df: pd.DataFrame, source: str | None = None) -> pd.DataFrame:
    """Coerce a long table to the canonical dtypes, drop duplicate steps (keep last), sort.

    The lineage columns (:data:`LINEAGE`) are kept when present (missing ones added empty).
    Metric names of earlier versions are renamed (:data:`RENAMED_METRICS`: ``ov_qk_bound`` is
    ``ov_gain_bound``). Rows whose ``step`` is not an integer within int64 (missing, fractional, ``1e30``,
    text), whose ``layer``/``head`` is not such an integer or missing, or whose ``value`` is
    not a number are dropped with one :class:`TrajectoryWarning` counting them
    (``source`` names where they came from).
    """
    import numpy as np

    pd = require_pandas()
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise TrajectoryError(f"table lacks column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
    step, bad_step = _int_column(df["step"], nullable=False)
    layer, bad_layer = _int_column(df["layer"], nullable=True)
    head, bad_head = _int_column(df["head"], nullable=True)
    value, bad_value = _float_column(df["value"])
    cols = {c: _str_column(df[c]) for c in ("run", "group", "metric")}
    bad = bad_step | bad_layer | bad_head | bad_value
    for _, b in cols.values():
        bad |= b
    metric = cols["metric"][0]
    if metric.isin(list(RENAMED_METRICS)).any():  # runs written before a metric was renamed
        metric = metric.replace(RENAMED_METRICS)
    out = pd.DataFrame({
        "run": cols["run"][0],
        "group": cols["group"][0],
        "step": step.fillna(0).astype("int64"),
        "layer": layer,
        "head": head,
        "metric": metric,
        "value": pd.Series(value, index=df.index, dtype="float64"),
    })
    if any(c in df.columns for c in LINEAGE):  # lineage: text ids or missing, an int64 step or missing
        for c in ("run_id", "parent_run"):
            text, bad_text = _optional_text_column(df[c]) if c in df.columns else (None, None)
            out[c] = text if text is not None else None
            if bad_text is not None:
                bad |= bad_text
        if "parent_step" in df.columns:
            parent_step, bad_parent = _int_column(df["parent_step"], nullable=True)
            out["parent_step"] = parent_step
            bad |= bad_parent
        else:
            out["parent_step"] = pd.array([pd.NA] * len(out), dtype="Int64")
    if bad.any():
        n = int(bad.sum())
        warnings.warn(
            f"{source or 'the table'}: skipped {n} row{'s' if n != 1 else ''} with an invalid step, layer, "
            "head, value or name (steps, layers and heads must be integers within int64)",
            TrajectoryWarning, stacklevel=3,
        )
        out = out[~np.asarray(bad)]
    out = out.drop_duplicates(subset=ROW_KEY, keep="last")
    out = out.sort_values(ROW_KEY, na_position="first", kind="stable").reset_index(drop=True)
    return out


def escape_formulas(values: pd.Series) -> pd.Series:
    """Text cells made inert for spreadsheets: a leading ``'`` before ``=``, ``+``, ``-``, ``@``,
    tab or carriage return (OWASP's CSV-injection rule), and before a leading ``'`` too, so that
    :func:`unescape_formulas` restores every name exactly. Only for text columns: numbers that
    start with ``-`` are values, not formulas."""
    text = values.astype(str)
    risky = text.str.startswith((*FORMULA_START, "'"))
    return text.where(~risky, "'" + text)


def unescape_formulas(values: pd.Series) -> pd.Series:
    """Inverse of :func:`escape_formulas` (a CSV written by ``export``, read back)."""
    text = values.astype(str)
    escaped = text.str.startswith(tuple("'" + c for c in (*FORMULA_START, "'")))
    return text.where(~escaped, text.str[1:])


def resolve_format(path: PathLike, format: str | None = None) -> str:
    """``csv``, ``parquet`` or ``jsonl`` from ``format`` or from the file name's suffix."""
    if format is not None:
        fmt = format.lower().lstrip(".")
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
        return fmt
    suffix = Path(path).suffix.lower()
    for fmt, suffixes in FORMATS.items():
        if suffix in suffixes:
            return fmt
    raise ValueError(
        f"cannot tell the format of {str(path)!r} from its suffix; use one of "
        f"{', '.join(s for ss in FORMATS.values() for s in ss)} or pass format="
    )
