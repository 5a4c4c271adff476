"""Hostile counts in model files (issue 23 item 6): one-line error, exit 2, in seconds and bounded memory.

Crafted files: GGUF files claiming ``block_count`` 2^32-1 or 1e8 for one block, and a valid
2-layer safetensors checkpoint whose ``config.json`` claims 20,000 or 1,000,000 layers. Each runs
the real CLI in a child process whose peak resident memory (``os.wait4``) and time are bounded.
Before the change: a ``MemoryError`` traceback (2^32-1), 1.8 GB (1e8), minutes and 7.7 GB (config).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
#: peak RSS a refused file may cost: the interpreter with torch and transformers imported is ~0.4 GB
MAX_RSS = 900 << 20
MAX_SECONDS = 90  # ~5 s measured on a busy 2-core machine; the old code ran for minutes


def run_cli(*argv) -> tuple[int, str, float, int]:
    """``python -m attn_probe ARGV``: exit status, stderr, seconds, the child's own peak RSS in bytes.

    The peak is the child's ``VmHWM`` (``/proc/self/status``), written at exit. Not ``wait4``'s
    ``ru_maxrss``: Linux carries the parent's high-water mark across ``exec`` into the child's
    ``ru_maxrss``, so that number was at least the pytest process's own peak (torch, transformers,
    the Llama fixture, plugins), not what the CLI allocated.
    """
    import tempfile

    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r", suffix=".hwm") as hwm:
        code = ("import atexit, runpy, sys\n"
                "def _hwm():\n"
                "    with open('/proc/self/status') as f:\n"
                "        kb = next(line.split()[1] for line in f if line.startswith('VmHWM:'))\n"
                f"    with open({hwm.name!r}, 'w') as out:\n"
                "        out.write(kb)\n"
                "atexit.register(_hwm)\n"
                "sys.argv[0] = 'attn-probe'\n"
                "runpy.run_module('attn_probe', run_name='__main__', alter_sys=True)\n")
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", code, *map(str, argv)],
                                stdout=subprocess.DEVNULL, stderr=err, env=ENV)
        while True:  # os.wait4 reaps it (a timeout must not leave it running)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > 2 * MAX_SECONDS:
                proc.kill()
                os.wait4(proc.pid, 0)
                pytest.fail(f"attn-probe {' '.join(map(str, argv))} still ran after {2 * MAX_SECONDS} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
        seconds = time.monotonic() - start
        err.seek(0)
        del usage  # its ru_maxrss includes the parent's peak (see above)
        peak = int(hwm.read() or 0) * 1024
        assert peak > 0, "the child wrote no VmHWM at exit"
        return proc.returncode, err.read().decode(errors="replace"), seconds, peak


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "[WARNING]" not in line]  # DeepSpeed's import note
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


# --------------------------------------------------------------------------- GGUF
def write_gguf(path: Path, block_count: int) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_embedding_length(32)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float32))
    writer.add_tensor("blk.0.attn_k.weight", rng.standard_normal((16, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("count", [2**32 - 1, 10**8])
def test_a_gguf_block_count_beyond_its_tensors_is_one_line(tmp_path, count):
    path = write_gguf(tmp_path / "hostile.gguf", count)
    code, err, seconds, peak = run_cli("score", path)
    assert code == 2
    line = one_line(err)
    assert line == (f"attn-probe score: error: {path}: the metadata says llama.block_count = {count}, but the file "
                    "holds tensors of 1 block (blk.N.*); the file is corrupt or was not written by llama.cpp's "
                    "converter")
    assert seconds < MAX_SECONDS and peak < MAX_RSS, (seconds, peak >> 20)


def test_the_true_block_count_still_scores(tmp_path):
    from attn_probe.scoring.gguf import score_gguf

    rows = score_gguf(write_gguf(tmp_path / "ok.gguf", 1))
    assert [(r["group"], r["layer"]) for r in rows] == [("self", 0)]


# --------------------------------------------------------------------------- config.json
@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaModel

    path = tmp_path_factory.mktemp("ckpt") / "llama2"
    LlamaModel(LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           intermediate_size=32, vocab_size=50)).save_pretrained(path)
    return path


def with_layers(src: Path, dst: Path, key: str, count: int) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if "." in key:  # a nested sub-config (multimodal models keep theirs in text_config)
        outer, inner = key.split(".")
        config[outer] = {**config.get(outer, {}), inner: count}
    else:
        config[key] = count
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("count", [20_000, 1_000_000])
def test_a_config_claiming_more_layers_than_tensors_is_one_line(llama_checkpoint, tmp_path, count):
    from safetensors import safe_open

    with safe_open(str(llama_checkpoint / "model.safetensors"), framework="pt") as fh:
        tensors = len(list(fh.keys()))
    ckpt = with_layers(llama_checkpoint, tmp_path / "hostile", "num_hidden_layers", count)
    for command in (["score", ckpt], ["heatmap", ckpt, "--layer", "0", "-o", tmp_path / "h.png"]):
        code, err, seconds, peak = run_cli(*command)
        assert code == 2
        line = one_line(err)
        assert line == (f"attn-probe {command[0]}: error: {ckpt}/config.json: num_hidden_layers = {count}, but the "
                        f"checkpoint holds {tensors} tensors and every layer needs at least one; config.json "
                        "does not describe these weights (corrupt or hostile)")
        assert seconds < MAX_SECONDS and peak < MAX_RSS, (command[0], seconds, peak >> 20)
    assert not (tmp_path / "h.png").exists()


def test_a_nested_count_is_checked_and_a_true_count_passes(llama_checkpoint, tmp_path):
    from attn_probe.scoring.checkpoint import CheckpointError, check_layer_counts

    check_layer_counts(llama_checkpoint)  # 2 layers, ~20 tensors
    nested = with_layers(llama_checkpoint, tmp_path / "nested", "text_config.num_hidden_layers", 5000)
    with pytest.raises(CheckpointError, match=r"text_config\.num_hidden_layers = 5000, but the checkpoint holds"):
        check_layer_counts(nested)


def test_the_library_path_refuses_a_hostile_count_before_building_the_model(llama_checkpoint, tmp_path):
    """``score_checkpoint`` (the Python API, not only the CLI) checks counts before the meta skeleton."""
    ckpt = with_layers(llama_checkpoint, tmp_path / "hostile", "num_hidden_layers", 1_000_000)
    code = ("import sys, attn_probe\n"
            "try:\n"
            f"    attn_probe.score_checkpoint({str(ckpt)!r})\n"
            "except attn_probe.CheckpointError as exc:\n"
            "    print(exc); sys.exit(3)\n")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=MAX_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"score_checkpoint ran past {MAX_SECONDS} s on a config claiming 1,000,000 layers")
    assert done.returncode == 3, done.stderr[-2000:]
    assert "num_hidden_layers = 1000000, but the checkpoint holds" in done.stdout
    assert time.monotonic() - start < MAX_SECONDS
