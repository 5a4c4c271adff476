import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "accelerate", "pandas", "matplotlib", "deepspeed", "tensorboard")


def test_import_is_light():
    code = (
        "import sys, attn_probe; heavy = [m for m in ('torch', 'transformers', 'accelerate', 'pandas', "
        "'matplotlib', 'deepspeed', 'tensorboard') if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_public_name_resolves():
    import attn_probe

    for name in dir(attn_probe):
        assert getattr(attn_probe, name) is not None, name


def test_star_import_gives_the_public_names():
    """``from attn_probe import *`` gives what the README uses (``__all__`` is the lazy table)."""
    code = "from attn_probe import *; print(sorted(k for k in dir() if not k.startswith('_')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    got = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    expected = {
        "watch", "attach", "AttnProbeCallback", "load_trajectory", "export_trajectory", "summarize",
        "plot_dynamics", "plot_heatmap", "score_model", "score_checkpoint", "symmetry_score",
        "directionality_score", "find_attention", "register_adapter", "unregister_adapter",
        "AttentionLayer", "UnsupportedModelError", "ProbeConfig", "Probe", "every", "log_spaced",
        "factored_scores", "score_factors", "CheckpointError", "LogDirError", "read_table",
        "layer_quantiles", "symmetric_init_", "AlertRule", "Alert",
    }
    assert got == expected
    import attn_probe

    assert sorted(attn_probe.__all__) == sorted([*expected, "__version__"])


def _modules_imported(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGV`` and return the run and every module it imported."""
    out = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120)
    # -X importtime writes "import time: self [us] | cumulative | imported package" per module
    modules = {m.group(1).strip() for m in re.finditer(r"^import time:\s*\d+ \|\s*\d+ \|(.*)$", out.stderr, re.M)}
    return out, modules


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["demo", "--help"], ["plot", "--help"]],
                         ids=["help", "version", "demo-help", "plot-help"])
def test_help_and_version_import_nothing_heavy(args):
    """``attn-probe --help``/``--version`` answer at once: no torch (it took 5-19 s through the demo)."""
    out, modules = _modules_imported(["-m", "attn_probe", *args])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "attn_probe.cli" in modules  # the record is read right
    assert not {m.split(".")[0] for m in modules} & set(HEAVY), sorted(m for m in modules if m.split(".")[0] in HEAVY)
    if args == ["--version"]:
        import attn_probe

        assert out.stdout.strip() == f"attn-probe {attn_probe.__version__}"


def test_the_console_script_imports_nothing_heavy():
    script = shutil.which("attn-probe", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the attn-probe console script is not installed beside this interpreter")
    out, modules = _modules_imported([script, "--help"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "attn_probe.cli" in modules
    assert "torch" not in modules


def test_the_version_is_the_changelogs_latest_release():
    import attn_probe

    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert releases and releases[0] == attn_probe.__version__ == "0.4.0"


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "attn_probe", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for command in ("score", "export", "plot", "summary", "heatmap", "demo"):
        assert command in out.stdout


def test_the_announcement_names_the_schedule_unit_in_the_singular(tmp_path, capsys):
    import torch
    from helpers import tiny_model
    from transformers import BertModel

    import attn_probe

    model = tiny_model("bert", None, cls=BertModel, vocab_size=32, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=16, max_position_embeddings=512)
    with attn_probe.watch(model, log_dir=tmp_path / "a", every=1):
        pass
    with attn_probe.watch(model, log_dir=tmp_path / "b", every=1, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)):
        pass
    err = capsys.readouterr().err
    assert "every training forward pass ->" in err
    assert "every optimizer step ->" in err
