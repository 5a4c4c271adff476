"""The module paths from before the 0.4 regrouping still import (issue 36), until 0.5.0.

Each check runs in a fresh interpreter: the finder warns once per old path and process, and a
module must never be loaded twice (once under its old name, once under its new one).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from attn_probe._compat import MOVED, REMOVED_IN

CHECK = """
import importlib, json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    old = importlib.import_module("attn_probe.{old}")
    again = importlib.import_module("attn_probe.{old}")
new = sys.modules["attn_probe.{new}"]
print(json.dumps({{
    "same": old is again is new,
    "name": old.__name__, "spec": old.__spec__.name,
    "copies": sorted(k for k, v in sys.modules.items() if getattr(v, "__file__", None) == new.__file__),
    "warnings": [(w.category.__name__, str(w.message)) for w in caught],
}}))
"""


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("old", "new"), [
    ("probe", "live.probe"),
    ("config", "live.config"),
    ("stages.decision", "live.stages.decision"),
    ("stages.assembly", "sinks.assembly"),
    ("attention_stats", "activations.statistics"),
    ("integrations.attention_functions", "activations.registry"),
    ("tags", "formats.tags"),
    ("reference", "definitions"),
    ("checkpoint", "scoring.checkpoint"),
])
def test_an_old_path_is_the_module_at_its_new_place_with_one_warning(old, new):
    got = run(CHECK.format(old=old, new=new))
    assert got["same"], got
    assert got["name"] == got["spec"] == f"attn_probe.{new}"  # the real module, not a renamed copy
    # loaded once: the old name is an alias in sys.modules of the same object, never a second load
    assert set(got["copies"]) <= {f"attn_probe.{new}", f"attn_probe.{old}"}
    ours = [m for c, m in got["warnings"] if f"attn_probe.{old} " in m and c == "DeprecationWarning"]
    assert ours == [f"attn_probe.{old} moved to attn_probe.{new}; the old path is removed in {REMOVED_IN}"]


def test_every_moved_path_resolves_and_names_an_existing_module():
    import importlib.util

    for old, new in MOVED.items():
        assert importlib.util.find_spec(f"attn_probe.{new}") is not None, (old, new)


def test_the_new_paths_and_the_public_names_never_warn():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import attn_probe\n"
            "from attn_probe import Probe, ProbeConfig, score_model, watch, symmetry_score, AlertRule\n"
            "from attn_probe.scoring import score_model\n"
            "import attn_probe.live.probe, attn_probe.scoring.checkpoint, attn_probe.sinks.assembly\n"
            "import json, sys; print(json.dumps({'ok': True}))")
    assert run(code)["ok"]


def test_a_pickle_written_under_an_old_path_loads():
    # what 0.3 wrote for an AlertRule: the class global under its old module, written by hand
    # (protocol 0 text) so that it does not depend on where the class lives now
    from attn_probe.live.alerts import AlertRule

    rule = AlertRule("max_logit", above=100.0)
    data = pickle.dumps(rule, protocol=0)
    assert b"attn_probe.live.alerts" in data
    legacy = data.replace(b"attn_probe.live.alerts", b"attn_probe.alerts")
    assert pickle.loads(legacy) == rule


def test_an_unknown_name_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        __import__("attn_probe.no_such_module")
