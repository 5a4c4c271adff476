import subprocess
import sys


def test_import_is_light():
    code = (
        "import sys, attn_probe; heavy = [m for m in ('transformers', 'accelerate', 'pandas', "
        "'matplotlib', 'deepspeed', 'tensorboard') if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
