"""The README: a front page whose commands work, the test command exactly what CI runs, paths that exist."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_block(section: str) -> str:
    """The first ``bash`` block under the README's ``## <section>`` heading."""
    text = (ROOT / "README.md").read_text()
    part = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", part, re.S)
    assert block, f"no bash block under {section}"
    return block.group(1)


def test_the_quickstart_makes_a_venv_installs_and_runs_the_demo():
    lines = [line for line in bash_block("Quickstart").splitlines() if line.strip()]
    assert lines[0].startswith("python3 -m venv ") and "activate" in lines[0]
    assert any('-e ".[all]"' in line for line in lines) and lines[-1] == "attn-probe demo"


def test_the_develop_command_is_exactly_what_ci_runs():
    command = bash_block("Develop")
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci, "the README's test command must be lines of .ci/run, as written"
    joined = command.replace("\\\n", " ")
    # a fresh environment every time, and the same install as CI
    assert joined.startswith("python3 -m venv --clear ")
    assert '-e ".[test]"' in joined and joined.rstrip().endswith("python -m pytest -q tests")


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    long = [n for n, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, f"README lines over 200 characters: {long}"


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


# --------------------------------------------------------------------------- paths the docs name
#: the repository's top-level folders (tracked); a path starting with one is a repository path
TOP_LEVEL = (".ci", "attn_probe", "benchmarks", "docs", "examples", "tests")
#: what a named file ends with (a name without a suffix or a final "/" is a tag or a run, not a path)
FILE_SUFFIX = re.compile(r"\.(py|md|cfg|toml|sh|csv|png|json|jsonl|txt)$")
PATH_TOKEN = re.compile(r"(?<![\w/.{-])(\.?[A-Za-z_][\w.-]*/(?:[\w.-]+/)*[\w.-]*)(?![\w{])")
#: placeholders written in capitals inside a path (``NAME.KIND.json``)
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{2,}\b")
#: a path written after these is a file the command creates
OUTPUT_FLAG = re.compile(r"(?:^|\s)(?:-o|--output|--out-dir|>)\s+$")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def package_folders() -> set[str]:
    return {p.name for p in (ROOT / "attn_probe").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def exists(path: str) -> bool:
    if PLACEHOLDER.search(path):
        return any(ROOT.glob(PLACEHOLDER.sub("*", path)))
    return (ROOT / path).exists()


def named_paths(text: str) -> list[str]:
    """Repository paths in ``text``: ``attn_probe/...``, ``tests/...`` (and the other top-level
    folders), and names inside the package written from its folders (``core/formulas.py``),
    each ending in a file suffix or ``/``. Paths a command is told to write are left out."""
    inside = package_folders()
    found = []
    for match in PATH_TOKEN.finditer(text):
        token = match.group(1).rstrip(".,;:")
        if not (token.endswith("/") or FILE_SUFFIX.search(token) or token == ".ci/run"):
            continue
        if OUTPUT_FLAG.search(text[max(0, match.start() - 12) : match.start()]):
            continue
        first = token.split("/")[0]
        if first in TOP_LEVEL:
            found.append(token)
        elif first in inside:
            found.append(f"attn_probe/{token}")
    return found


LAYOUT_NAMES = re.compile(r"^( {0,2})([\w.-]+(?:/[\w.-]*)*(?:, [\w.-]+(?:/[\w.-]*)*)*)")


def layout_paths() -> list[str]:
    """The files and folders of the README's Layout block: ``attn_probe/a.py, b.py`` names
    ``attn_probe/b.py`` too, and an entry indented by two spaces is in the folder named above it
    (deeper indentation continues a description)."""
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    paths: list[str] = []
    folder = ""
    for line in block.splitlines():
        match = LAYOUT_NAMES.match(line)
        if not match:
            continue
        indented, names = bool(match.group(1)), match.group(2).split(", ")
        if indented:
            paths += [folder + name for name in names]
            continue
        first = names[0]
        folder = first if first.endswith("/") else folder
        beside = first.rstrip("/").rpartition("/")[0] + "/"  # the folder holding the first name
        paths += [first] + [beside + name for name in names[1:]]
    return paths


def test_every_repository_path_the_docs_name_exists():
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in documents()
        for path in named_paths(doc.read_text(encoding="utf-8"))
        if not exists(path)
    ]
    assert not missing, missing


def test_every_entry_of_the_readme_layout_exists():
    paths = layout_paths()
    assert "attn_probe/live/stages/" in paths and "attn_probe/isolation.py" in paths  # the block is read
    missing = [path for path in paths if not exists(path)]
    assert not missing, missing
