import subprocess
import sys


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
