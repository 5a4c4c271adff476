"""The demo's run management at tiny sizes: models trained at the same time (one process each)
against one after the other, a failing process, --resume, reruns, and the printed commands."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import stop_process_group

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attn_probe import demo  # noqa: E402
from attn_probe.cli import main  # noqa: E402
from attn_probe.demo.processes import describe_failure  # noqa: E402
from attn_probe.formats.tags import scalar_tag  # noqa: E402

TINY = ["--size", "tiny", "--steps", "6", "--batch-size", "4", "--seq-len", "16", "--every", "2",
        "--vocab-size", "200", "--max-chars", "20000", "--no-progress", "--no-figure", "--threads", "1"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "attn_probe.jsonl").read_text().splitlines() if line.strip() and '"run_header"' not in line]


def _values(run_dir: Path) -> dict[tuple, float]:
    """(step, layer, head, metric) -> value, from the trajectory file; each key written once."""
    rows = _rows(run_dir)
    keys = [(r["step"], r["layer"], r["head"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys)), "a step written twice"
    return {(r["step"], r["layer"], r["head"], r["metric"]): r["value"] for r in rows}


def _tb_loss(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_concurrent_equals_sequential(tmp_path):
    """The same tokenizer and blocks (the WordPiece trainer breaks ties run-dependently), seeds and
    threads: the models trained in two processes at once match those trained one after the other."""
    cfg = demo.DemoConfig(size="tiny", steps=6, batch_size=4, seq_len=16, every=2, vocab_size=200,
                          max_chars=20_000, progress=False, figure=False)
    tokenizer, blocks = demo.prepare_data(cfg)
    budget = demo.CpuBudget(2, None, 0.0)
    results = {}
    for name, concurrent in (("seq", False), ("con", True)):
        plan = demo.plan_threads(budget, models=2, threads=1, concurrent=concurrent)
        results[name], failures = demo.train_models(cfg, tokenizer, blocks, tmp_path / name, plan, log=lambda s: None)
        assert failures == {} and list(results[name]) == ["encoder", "decoder"]
    for kind in ("encoder", "decoder"):
        a, b = tmp_path / "seq" / kind, tmp_path / "con" / kind
        assert _values(a) == _values(b)  # exactly
        assert {k[0] for k in _values(a)} == {0, 2, 4, 6}
        assert _tb_loss(a) == _tb_loss(b) and len(_tb_loss(a)) == 3
        assert results["seq"][kind].losses == results["con"][kind].losses
        assert results["seq"][kind].rows == results["con"][kind].rows
        wa, wb = _weights(a / "model"), _weights(b / "model")
        assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_the_printed_commands_run_on_the_final_models(tmp_path, capsys):
    assert main(["demo", *TINY, "--out-dir", str(tmp_path), "--name", "con", "--concurrent"]) == 0
    out = capsys.readouterr().out
    assert "--concurrent: the models train at the same time, one process each" in out
    assert "training the encoder (masked LM, bidirectional) in its own process" in out
    # the final models the demo points to are the trained ones ...
    import transformers

    from attn_probe import score_model

    result_rows = {}
    for kind, cls in (("encoder", "RobertaPreLayerNormForMaskedLM"), ("decoder", "RobertaPreLayerNormForCausalLM")):
        model_dir = tmp_path / "con" / kind / "model"
        assert str(model_dir) in out
        model = getattr(transformers, cls).from_pretrained(str(model_dir))
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        # the cpu preset's character tokenizer of the same 20,000 characters (not --vocab-size's 200)
        assert tok.get_vocab() == demo.make_tokenizer(demo.load_texts(max_chars=20_000), "chars").get_vocab()
        result_rows[kind] = score_model(model)
        final = {(r["layer"], r["head"], r["metric"]): r["value"] for r in _rows(tmp_path / "con" / kind)
                 if r["step"] == 6}
        for r in result_rows[kind]:
            if r["head"] is None:
                assert r["symmetry"] == pytest.approx(final[(r["layer"], None, "symmetry")], rel=1e-5, abs=1e-6)
    # ... and the commands it prints run, exactly as printed
    commands = [ln.strip() for ln in out.splitlines() if ln.startswith("  attn-probe ")]
    assert [c.split()[1] for c in commands] == ["score", "score", "heatmap", "heatmap"]
    # the heatmaps: the encoder's most symmetric layer and the decoder's most directional one, from the
    # scores of the models as loaded here (the lowest layer on a tie)
    layer_rows = {kind: [r for r in rows if r["head"] is None] for kind, rows in result_rows.items()}
    enc_best = max(layer_rows["encoder"], key=lambda r: r["symmetry"])["layer"]
    dec_best = max(layer_rows["decoder"], key=lambda r: abs(r["directionality"]))["layer"]
    assert f"encoder/model --layer {enc_best} -o " in commands[2] and f"decoder/model --layer {dec_best} -o " in commands[3]
    assert f"the encoder's most symmetric layer ({enc_best}: symmetry " in out
    assert f"the decoder's most directional layer ({dec_best}: directionality " in out
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for command in commands:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, (command, done.stderr)
        if command.startswith("attn-probe score"):
            kind = "encoder" if "/encoder/" in command else "decoder"
            for r in result_rows[kind]:  # the scores of the model as loaded here
                if r["head"] is None:
                    assert f"{r['symmetry']:+.3f}" in done.stdout or f"{r['symmetry']:.3f}" in done.stdout, done.stdout
    for figure in (tmp_path / "con" / f"encoder_layer{enc_best}.png", tmp_path / "con" / f"decoder_layer{dec_best}.png"):
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ... and so does its one TensorBoard command: both models and the paper's matching runs
    (tensorboard,) = set(re.findall(r"(tensorboard --logdir \S+ --samples_per_plugin scalars=\d+)$", out, re.M))
    assert "the paper's figure is the first chart of Custom Scalars: http://localhost:6006/#custom_scalars" in out
    served = _serve_as_printed(tensorboard, env, scalar_tag("self", "symmetry", stat="median"))
    assert set(served) == {"encoder", "decoder", "paper-4-layer-encoder-wikipedia", "paper-4-layer-decoder-wikipedia"}
    assert [step for _, step, _ in served["encoder"]] == [0, 2, 4, 6]
    assert [step for _, step, _ in served["paper-4-layer-decoder-wikipedia"]] == [1000]


def _serve_as_printed(command: str, env: dict, tag: str, timeout: float = 120) -> dict[str, list]:
    """Run a printed ``tensorboard`` command; the custom-scalars data of ``tag``, run -> points,
    once every run is loaded (TensorBoard scans for a free port from 6006 and prints its address)."""
    import time
    import urllib.parse
    import urllib.request

    proc = subprocess.Popen(command, shell=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        base, seen = None, []
        while base is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail("tensorboard exited: " + "".join(seen)[-2000:])
            seen.append(line)
            found = re.search(r"(http://\S+?)/? \(Press CTRL\+C", line)
            base = found.group(1) if found else None
        assert base, "".join(seen)[-2000:]
        served: dict[str, list] = {}
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{base}/data/runs", timeout=10) as resp:
                runs = json.loads(resp.read())
            served = {}
            for run in runs:
                query = urllib.parse.urlencode({"run": run, "tag": tag})
                with urllib.request.urlopen(f"{base}/data/plugin/custom_scalars/scalars?{query}", timeout=10) as resp:
                    events = json.loads(resp.read())["tag_to_events"].get(tag)
                if events:
                    served[run] = events
            if len(served) >= 4:
                break
            time.sleep(1)
        # the printed figure address: the Custom Scalars dashboard is on, its first chart the paper's figure
        with urllib.request.urlopen(f"{base}/data/plugins_listing", timeout=10) as resp:
            assert json.loads(resp.read())["custom_scalars"]["enabled"]
        with urllib.request.urlopen(f"{base}/data/plugin/custom_scalars/layout", timeout=10) as resp:
            first = json.loads(resp.read())["category"][0]
        assert first["title"] == "attn_probe/self: symmetry, the paper's figure", first
        return served
    finally:
        stop_process_group(proc)  # the server and its children


def _corrupt_checkpoint(trainer_dir: Path) -> None:
    ckpt = max((p for p in trainer_dir.iterdir() if p.name.startswith("checkpoint-")),
               key=lambda p: int(p.name.split("-")[1]))
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")


@pytest.mark.parametrize("mode", ["--concurrent", "--sequential"])
def test_a_failing_model_is_reported_and_the_other_kept(tmp_path, capsys, mode):
    args = [*TINY, "--save-every", "3", "--out-dir", str(tmp_path), "--name", "f", mode]
    assert main(["demo", *args]) == 0
    shutil.rmtree(tmp_path / "f" / "encoder" / "trainer" / "checkpoint-6")  # the encoder resumes from 3
    _corrupt_checkpoint(tmp_path / "f" / "decoder" / "trainer")  # the decoder cannot resume
    capsys.readouterr()
    assert main(["demo", *args, "--resume"]) == 1
    out = capsys.readouterr().out
    assert "  decoder: failed (" in out and "decoder: did not finish (" in out
    assert "(resumed from checkpoint-3)" in out
    table = out[out.index("symmetry median"):]
    assert any(ln.startswith("encoder  ") for ln in table.splitlines())
    assert not any(ln.startswith("decoder  ") for ln in table.splitlines())
    assert "  attn-probe score " + str(tmp_path / "f" / "encoder" / "model") in out
    assert "attn-probe score " + str(tmp_path / "f" / "decoder" / "model") not in out
    assert (tmp_path / "f" / "encoder" / "model" / "config.json").is_file()
    assert (tmp_path / "f" / "decoder" / "attn_probe.jsonl").is_file()  # the failed model's files are kept


def test_a_killed_process_is_named():
    import multiprocessing
    import signal
    import time

    p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    p.start()
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert describe_failure(p.exitcode, Path("/nonexistent/result.json")) == (
        "its process was killed by signal 9 (SIGKILL)")


def test_concurrent_resume_continues_both_models(tmp_path, capsys):
    args = [*TINY, "--save-every", "3", "--out-dir", str(tmp_path), "--name", "r", "--concurrent"]
    assert main(["demo", *args]) == 0
    whole = {kind: _values(tmp_path / "r" / kind) for kind in ("encoder", "decoder")}
    for kind in ("encoder", "decoder"):
        shutil.rmtree(tmp_path / "r" / kind / "trainer" / "checkpoint-6")  # stopped after step 3
    capsys.readouterr()
    assert main(["demo", *args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert out.count("(resumed from checkpoint-3)") == 2
    assert f"tokenizer: {tmp_path / 'r' / 'tokenizer'}, the one the checkpoints were trained with" in out
    for kind in ("encoder", "decoder"):
        resumed = _values(tmp_path / "r" / kind)  # asserts no step written twice
        assert {k[0] for k in resumed} == {0, 2, 3, 4, 6}  # 3: the resume snapshot
        # before the checkpoint: the first command's records, kept
        for key, value in whole[kind].items():
            if key[0] <= 2:
                assert resumed[key] == value, key
        assert [s for s, _ in _tb_loss(tmp_path / "r" / kind)] == [2, 4, 6]


def test_a_rerun_starts_afresh_and_says_so(tmp_path, capsys):
    args = [*TINY, "--models", "encoder", "--sequential", "--out-dir", str(tmp_path), "--name", "a"]
    assert main(["demo", *args]) == 0
    capsys.readouterr()
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert f"encoder: {tmp_path / 'a' / 'encoder'} held an earlier run: removed it, starting afresh" in out
    assert {k[0] for k in _values(tmp_path / "a" / "encoder")} == {0, 2, 4, 6}  # one run, not two appended
    assert [s for s, _ in _tb_loss(tmp_path / "a" / "encoder")] == [2, 4, 6]
    assert len(list((tmp_path / "a" / "encoder").glob("events.out.tfevents.*"))) == 2  # probe + Trainer, once


def test_resume_without_a_checkpoint_starts_afresh(tmp_path, capsys):
    args = [*TINY, "--models", "encoder", "--sequential", "--save-every", "100", "--out-dir", str(tmp_path),
            "--name", "n"]
    assert main(["demo", *args]) == 0
    shutil.rmtree(tmp_path / "n" / "encoder" / "trainer")  # stopped before its first checkpoint
    capsys.readouterr()
    assert main(["demo", *args, "--resume"]) == 0
    assert "encoder: no checkpoint under" in capsys.readouterr().out
    assert [s for s, _ in _tb_loss(tmp_path / "n" / "encoder")] == [2, 4, 6]
    assert {k[0] for k in _values(tmp_path / "n" / "encoder")} == {0, 2, 4, 6}


def test_resume_of_a_finished_run_trains_nothing(tmp_path, capsys):
    """The Trainer saves a checkpoint at the last step; resuming from it trained one step past
    --steps (transformers 5.23) and wrote that step into the trajectory."""
    args = [*TINY, "--models", "encoder", "--sequential", "--save-every", "3", "--out-dir", str(tmp_path),
            "--name", "d"]
    assert main(["demo", *args]) == 0
    run = tmp_path / "d" / "encoder"
    before = _values(run)
    capsys.readouterr()
    assert main(["demo", *args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "(resumed from checkpoint-6)" in out
    assert _values(run) == before  # no step 7, nothing rewritten
    assert sorted(p.name for p in (run / "trainer").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    # the table and the saved model are the finished model's
    final = sorted(v for (step, layer, head, metric), v in before.items()
                   if step == 6 and head is None and metric == "symmetry")
    table = next(ln for ln in out.splitlines() if ln.startswith("encoder  "))
    assert f"{(final[0] + final[1]) / 2:+.3f}" in table
    assert (run / "model" / "model.safetensors").is_file()


def test_a_directory_with_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "x" / "encoder").mkdir(parents=True)
    (tmp_path / "x" / "encoder" / "notes.txt").write_text("mine")
    assert main(["demo", *TINY, "--out-dir", str(tmp_path), "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert "holds files the demo did not write (notes.txt)" in err and err.strip().count("\n") == 0
    assert (tmp_path / "x" / "encoder" / "notes.txt").read_text() == "mine"
