"""The README's Quickstart: two commands, the test one exactly what CI runs."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block under Quickstart"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_has_two_commands_the_second_is_what_ci_runs():
    main_job, tests = quickstart_commands()
    assert "attn-probe demo" in main_job
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the README's test command must be a line of .ci/run, as written"
    # a fresh environment every time, and the same install as CI
    assert tests.startswith("python3 -m venv --clear ")
    assert '-e ".[test]"' in tests and tests.endswith("python -m pytest -q tests")


def test_the_extras_the_readme_describes_exist():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    text = (ROOT / "README.md").read_text()
    for name in re.findall(r"`\[(\w+)\]`", text):
        assert name in extras, f"README names extra [{name}] that setup.cfg does not define"
    all_extra = extras["all"]
    for absent in ("wandb", "mlflow", "trackio", "gguf", "deepspeed"):
        assert absent not in all_extra, f"README says [all] does not hold {absent}"
