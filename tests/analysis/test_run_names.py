"""Run names: ``NAME=PATH`` on ``attn-probe plot|summary|export``, and a Trainer run named after its
``output_dir`` (not its ``runs/<time>_<host>`` directory), through ``attn_probe.cli.main`` in-process
and ``load_trajectory``."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import RandomTokens, make_args, tiny_bert
from transformers import Trainer

import attn_probe
from attn_probe.analysis.trajectory import NamedRun, find_runs, parse_run_argument
from attn_probe.cli import main


def probe_run(log_dir: Path, steps: int = 2, seed: int = 0) -> Path:
    """A small real run: the probe on a tiny model, ``steps`` SGD updates."""
    model = tiny_bert(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=1):
        for i in range(steps):
            ids = RandomTokens()[i]["input_ids"][None]
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    return log_dir


def summary_runs(*args: str) -> list[str]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["summary", "--format", "csv", *args]) == 0
    return sorted(set(pd.read_csv(io.StringIO(out.getvalue()))["run"]))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return probe_run(root / "a"), probe_run(root / "b", seed=1)


def test_name_eq_path_names_the_runs_in_summary_export_and_plot(tmp_path, two_runs):
    a, b = two_runs
    assert summary_runs(f"enc={a}", f"dec={b}") == ["dec", "enc"]
    assert summary_runs(f"enc={a}", str(b)) == ["b", "enc"]  # mixed: the other keeps its directory's name
    assert summary_runs(f"enc={a.parent}") == ["enc/a", "enc/b"]  # a parent: nested runs are NAME/sub

    assert main(["export", f"first={a}", f"second={b}", "-o", str(tmp_path / "all.csv")]) == 0
    assert sorted(set(pd.read_csv(tmp_path / "all.csv")["run"])) == ["first", "second"]

    pytest.importorskip("matplotlib")
    assert main(["plot", f"enc={a}", f"dec={b}", "-o", str(tmp_path / "fig.png")]) == 0
    assert (tmp_path / "fig.png").stat().st_size > 0
    fig = attn_probe.plot_dynamics([parse_run_argument(f"enc={a}"), parse_run_argument(f"dec={b}")])
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)  # under the panels
    legend = {t.get_text() for lg in legends for t in lg.get_texts()}  # when the runs logged a random range
    assert {"enc", "dec"} <= legend, legend


def test_name_eq_path_parsing_and_errors(tmp_path, two_runs, capsys):
    a, b = two_runs
    assert parse_run_argument(f"x={a}") == NamedRun("x", str(a))
    assert parse_run_argument(str(a)) == str(a)
    odd = tmp_path / "lr=0.1"  # an existing directory whose name holds '=' stays a path
    probe_run(odd)
    assert parse_run_argument(str(odd)) == str(odd)
    assert summary_runs(str(odd)) == ["lr=0.1"]
    assert main(["summary", f"x={a}", f"x={b}"]) == 2
    assert "run name given twice: x" in capsys.readouterr().err
    assert main(["summary", f"x={tmp_path / 'missing'}"]) == 2
    # an explicit name that equals another run's default name: the default one is made unique
    assert [n for n, _ in find_runs([NamedRun("b", a), b])] == ["b", "b#2"]


def test_trainer_run_is_named_after_its_output_dir(tmp_path):
    out = tmp_path / "my-finetune"
    trainer = Trainer(model=tiny_bert(), args=make_args(out, 2, report_to=["tensorboard"]),
                      train_dataset=RandomTokens())
    attn_probe.attach(trainer, every=1)
    trainer.train()
    (run_dir,) = [d for d in (out / "runs").iterdir()]  # runs/<Mon DD_HH-MM-SS>_<host>
    assert set(attn_probe.load_trajectory(str(out))["run"]) == {"my-finetune"}
    assert set(attn_probe.load_trajectory(str(run_dir))["run"]) == {"my-finetune"}
    assert summary_runs(str(out)) == ["my-finetune"]
    assert summary_runs(f"ft={out}") == ["ft"]


def test_trainer_style_run_dirs_are_made_unique(tmp_path):
    for d in ("x/out/runs/Nov23_11-49-27_host", "y/out/runs/Nov23_11-50-01_host",
              "z/out/runs/Nov23_11-49-27_host", "z/out/runs/Nov23_12-00-00_host_1"):
        probe_run(tmp_path / d, steps=1)
    got = [n for n, _ in find_runs([tmp_path / "x", tmp_path / "y"])]
    assert got == ["x/out", "y/out"]  # two output dirs with one name: their parents are added
    got = [n for n, _ in find_runs(tmp_path / "z")]
    assert got == ["out/Nov23_11-49-27_host", "out/Nov23_12-00-00_host_1"]  # one output dir, two runs
    assert set(attn_probe.load_trajectory(str(tmp_path / "x"))["run"]) == {"out"}
    # a directory that only looks like a timestamp elsewhere keeps its own name
    probe_run(tmp_path / "w" / "logs" / "Nov23_11-49-27_host", steps=1)
    assert [n for n, _ in find_runs(tmp_path / "w")] == ["Nov23_11-49-27_host"]
