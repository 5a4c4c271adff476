"""The module paths from before the 0.4 regrouping are gone in 0.5.0, as promised (issue 44, item 10).

``import attn_probe`` installs nothing in the import system: no finder on ``sys.meta_path``, no
path hook, no path entry, so that it costs other imports nothing (the old-path finder sat first
on ``sys.meta_path`` for the life of the process). Each old path is a plain
``ModuleNotFoundError`` now, and CHANGELOG.md names it with its new home.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: old path (under ``attn_probe.``) -> its home since 0.4 (``metrics``, ``scores``: deprecated in 0.3)
REMOVED = {
    "probe": "live.probe",
    "config": "live.config",
    "schedules": "live.schedules",
    "counting": "live.counting",
    "asynchronous": "live.asynchronous",
    "resume_policy": "live.resume_policy",
    "images": "live.images",
    "alerts": "live.alerts",
    "stages": "live.stages",
    "stages.decision": "live.stages.decision",
    "stages.assembly": "sinks.assembly",
    "pairs": "scoring.pairs",
    "checkpoint": "scoring.checkpoint",
    "gguf": "scoring.gguf",
    "op_count": "core.op_count",
    "reference": "definitions",
    "attention_stats": "activations.statistics",
    "integrations.attention_functions": "activations.registry",
    "tags": "formats.tags",
    "logdir": "formats.logdir",
    "tracker_record": "sinks.tracker_record",
    "live_view": "sinks.live_view",
    "metrics": "core",
    "scores": "definitions",
}

CHECK = """
import importlib, json, sys
hooks = (list(sys.meta_path), list(sys.path_hooks), list(sys.path))
import attn_probe
from attn_probe import Probe, ProbeConfig, score_model, watch  # the public names load the package's modules
after = (list(sys.meta_path), list(sys.path_hooks), list(sys.path))
got = {"same_hooks": hooks == after, "meta_path": [type(f).__name__ for f in after[0]], "old": {}, "new": {}}
for old, new in json.loads(sys.argv[1]).items():
    try:
        importlib.import_module("attn_probe." + old)
        got["old"][old] = "imported"
    except ModuleNotFoundError as error:
        got["old"][old] = error.name
    importlib.import_module("attn_probe." + new)
    got["new"][new] = "attn_probe." + new in sys.modules
print(json.dumps(got))
"""


def test_import_attn_probe_installs_no_import_hook_and_the_old_paths_are_gone():
    out = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(REMOVED)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same_hooks"], got["meta_path"]
    # each old path is a plain ModuleNotFoundError naming the old module (or its missing parent)
    for old, name in got["old"].items():
        assert name in {f"attn_probe.{old}", f"attn_probe.{old.split('.')[0]}"}, (old, name)
    assert all(got["new"].values()), got["new"]


def test_the_changelog_names_each_removed_path_with_its_new_home():
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    unreleased = changelog.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    removed = unreleased.split("### Removed", 1)[1].split("\n### ", 1)[0]
    entry = next(part for part in re.split(r"\n- ", removed) if "attn_probe.probe" in part)
    entry = " ".join(entry.split())
    for old, new in REMOVED.items():
        parent, _, rest = old.partition(".")
        if rest and parent in REMOVED and new == f"{REMOVED[parent]}.{rest}":
            continue  # a submodule that moved with its package: the package's entry covers it
        assert f"`attn_probe.{old}` → `attn_probe.{new}`" in entry, (old, new)
