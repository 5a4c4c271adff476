"""The import paths the issue 30 refactor retired still work, each with one DeprecationWarning.

Each check runs in a fresh interpreter: the warning is given once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CODE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from attn_probe.{old} import {name}
    from attn_probe.{old} import {name} as again
    import attn_probe.{new} as new
print(json.dumps({{"same": {name} is again is getattr(new, "{name}"),
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught
                               if "attn_probe.{old}" in str(w.message)]}}))
"""


@pytest.mark.parametrize(("old", "new", "name"), [
    ("metrics", "core", "score_factors"),
    ("metrics", "core", "METRICS"),
    ("scores", "definitions", "symmetry_score"),
    ("scores", "core", "gram_is_cheaper"),
], ids=["metrics.score_factors", "metrics.METRICS", "scores.symmetry_score", "scores.gram_is_cheaper"])
def test_old_path_gives_the_same_object_with_one_warning(old, new, name):
    out = subprocess.run([sys.executable, "-c", CODE.format(old=old, new=new, name=name)],
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"]
    assert [w[0] for w in got["warnings"]] == ["DeprecationWarning"], got["warnings"]
    # the one warning says where the name lives now and the release that removes the old path
    message = got["warnings"][0][1]
    assert f"import {name} from attn_probe.{new}" in message, message
    assert "removed in 0.5.0" in message, message


def test_the_removal_release_is_the_changelogs():
    """The version the warnings name is the one CHANGELOG.md announces for these paths."""
    from pathlib import Path

    import attn_probe.metrics as old_metrics
    import attn_probe.scores as old_scores

    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text(encoding="utf-8")
    deprecated = [part.split("\n## ", 1)[0].split("\n### ", 1)[0] for part in changelog.split("### Deprecated")[1:]]
    for path, module in (("attn_probe.metrics", old_metrics), ("attn_probe.scores", old_scores)):
        assert module.REMOVED_IN == "0.5.0"
        assert any(f"`{path}`" in part and module.REMOVED_IN in part for part in deprecated), path


def test_unknown_names_are_attribute_errors():
    import attn_probe.metrics as old_metrics
    import attn_probe.scores as old_scores

    with pytest.raises(AttributeError):
        old_metrics.no_such_name  # noqa: B018
    with pytest.raises(AttributeError):
        old_scores._directionality_batch  # noqa: B018  (private: gone, not forwarded)
