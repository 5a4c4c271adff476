"""A reused log_dir: the runs one trajectory file holds load as separate runs (issue 23, item 9).

Every file here is written by real runs through ``attn_probe.watch()`` on a tiny BERT in plain
training loops: two fresh runs in one ``log_dir`` (the second appends, its steps start again at
0), a run that stopped after its step-0 snapshot followed by a fresh one, and a run resumed with
``start_step`` (its sink cuts the file at the resume step; it must stay one run). The reference
values are the layer matrices ``M = W_q^T W_k`` built from each model's own projection weights
at every snapshot step and scored in float64 here (``<M, M^T>_F / ||M||_F^2``). The loader, the
export, ``attn-probe summary`` and ``attn-probe plot`` are checked, the CLI through
``python -m attn_probe`` subprocesses.
"""

from __future__ import annotations

import copy
import csv
import io
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")
from helpers import tiny_model  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe import load_trajectory  # noqa: E402
from attn_probe.analysis.trajectory import TrajectoryWarning  # noqa: E402

VOCAB, SEQ, EVERY = 40, 8, 10
#: live probe against the float64 reference (docs/architecture.md: 1e-6 * max(1, |b|); |symmetry| <= 1)
TOL = 1e-6


def tiny_bert(seed):
    return tiny_model("bert", seed, vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=SEQ)


def reference(model):
    """``{layer: symmetry}`` of ``M = W_q^T W_k`` (sum over heads), in float64, from the weights."""
    out = {}
    for i, layer in enumerate(model.bert.encoder.layer):
        q = layer.attention.self.query.weight.detach().double()
        k = layer.attention.self.key.weight.detach().double()
        m = q.T @ k
        out[i] = float((m * m.T).sum() / (m * m).sum())
    return out


def train(model, log_dir, steps, data_seed, start_step=0, state=None):
    """``steps`` Adam steps watched every ``EVERY``; returns ``{step: reference(model)}`` at the
    snapshot steps, and the model/optimizer state at ``EVERY`` when ``state`` is a dict."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if start_step:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    refs = {start_step: reference(model)}
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=EVERY, start_step=start_step)
    g = torch.Generator().manual_seed(data_seed)
    for step in range(start_step + 1, start_step + steps + 1):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            refs[step] = reference(model)
            if state is not None and step == EVERY and not start_step:
                state.update(model={k: v.clone() for k, v in model.state_dict().items()},
                             opt=copy.deepcopy(opt.state_dict()))
    probe.close()
    return refs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``reused/``: run A (steps 0-40), then run B (0-20) in the same log_dir;
    ``stopped/``: a run with only its step-0 snapshot, then a fresh run (0-10);
    ``resumed/``: run A (0-20), resumed from its step-10 state with other data (10-30), then a
    fresh run B (0-20) in the same log_dir."""
    root = tmp_path_factory.mktemp("runs")
    refs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sink's "already holds a trajectory" at write time
        refs["reused"] = [train(tiny_bert(0), root / "reused", 40, data_seed=1),
                          train(tiny_bert(1), root / "reused", 20, data_seed=2)]
        refs["stopped"] = [train(tiny_bert(2), root / "stopped", 0, data_seed=3),
                           train(tiny_bert(3), root / "stopped", 10, data_seed=4)]
        state: dict = {}
        first = train(tiny_bert(4), root / "resumed", 20, data_seed=5, state=state)
        resumed = train(tiny_bert(4), root / "resumed", 20, data_seed=6, start_step=EVERY, state=state)
        refs["resumed"] = [{**first, **resumed}, train(tiny_bert(5), root / "resumed", 20, data_seed=7)]
        refs["resumed_original"] = first
    return root, refs


def layer_symmetry(df, run):
    """``{step: {layer: value}}`` of one run's layer-level symmetry rows."""
    sub = df[(df["run"] == run) & df["head"].isna() & (df["metric"] == "symmetry")]
    out: dict[int, dict[int, float]] = {}
    for step, layer, value in zip(sub["step"], sub["layer"], sub["value"], strict=True):
        out.setdefault(int(step), {})[int(layer)] = float(value)
    return out


def assert_matches(got, want):
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), step
        for layer, value in want[step].items():
            assert got[step][layer] == pytest.approx(value, abs=TOL), (step, layer)


def load_warned(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_trajectory(path)
    return df, [str(w.message) for w in caught if issubclass(w.category, TrajectoryWarning)]


@pytest.mark.parametrize("case", ["reused", "stopped"])
def test_two_fresh_runs_in_one_log_dir_load_as_two_runs(runs, case):
    root, refs = runs
    df, warned = load_warned(root / case)
    assert list(dict.fromkeys(df["run"])) == [case, f"{case}#2"]
    for name, want in zip([case, f"{case}#2"], refs[case], strict=True):
        assert_matches(layer_symmetry(df, name), want)
    assert len(warned) == 1, warned
    assert "holds 2 runs" in warned[0] and f"{case}#2" in warned[0]
    first_steps, second_steps = sorted(refs[case][0]), sorted(refs[case][1])
    assert f"{case} (step{'s' if len(first_steps) > 1 else ''} 0" in warned[0]
    assert f"{case}#2 (steps 0 to {second_steps[-1]})" in warned[0]


def test_a_resumed_run_stays_one_run_beside_a_fresh_one(runs):
    root, refs = runs
    df, warned = load_warned(root / "resumed")
    assert list(dict.fromkeys(df["run"])) == ["resumed", "resumed#2"]
    got = layer_symmetry(df, "resumed")
    assert sorted(got) == [0, 10, 20, 30]
    assert_matches(got, refs["resumed"][0])  # steps 10-30 from the resumed training
    original = refs["resumed_original"][20]
    assert all(abs(got[20][la] - original[la]) > 1e-2 for la in original)  # the old step 20 was replaced
    assert_matches(layer_symmetry(df, "resumed#2"), refs["resumed"][1])
    assert len(warned) == 1 and "holds 2 runs" in warned[0], warned


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "attn_probe", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_export_csv_names_each_run(runs, tmp_path):
    root, refs = runs
    out = tmp_path / "all.csv"
    proc = cli("export", root / "reused", "-o", out)
    warned = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1 and "holds 2 runs" in warned[0], proc.stderr
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for name, want in zip(["reused", "reused#2"], refs["reused"], strict=True):
        got: dict[int, dict[int, float]] = {}
        for r in rows:
            if r["run"] == name and r["metric"] == "symmetry" and r["head"] == "":
                got.setdefault(int(r["step"]), {})[int(r["layer"])] = float(r["value"])
        assert_matches(got, want)
    assert {r["run"] for r in rows} == {"reused", "reused#2"}


def test_summary_cli_reports_each_run(runs):
    root, refs = runs
    text = cli("summary", root / "reused")
    assert "run reused\n" in text.stdout and "run reused#2\n" in text.stdout
    warned = [line for line in text.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1 and "holds 2 runs" in warned[0], text.stderr
    table = list(csv.DictReader(io.StringIO(cli("summary", "--format", "csv", root / "reused").stdout)))
    sym = {r["run"]: r for r in table if r["metric"] == "symmetry"}
    assert set(sym) == {"reused", "reused#2"}
    for name, want in zip(["reused", "reused#2"], refs["reused"], strict=True):
        first, last = min(want), max(want)
        assert int(sym[name]["first_step"]) == first and int(sym[name]["last_step"]) == last
        assert float(sym[name]["first_median"]) == pytest.approx(np.median(list(want[first].values())), abs=TOL)
        assert float(sym[name]["last_median"]) == pytest.approx(np.median(list(want[last].values())), abs=TOL)


def test_plot_draws_each_run(runs, tmp_path):
    from attn_probe.analysis.plots import plot_dynamics, use_agg

    root, refs = runs
    use_agg()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = plot_dynamics(root / "reused")
    warned = [str(w.message) for w in caught if issubclass(w.category, TrajectoryWarning)]
    assert len(warned) == 1 and "holds 2 runs" in warned[0], warned
    ax = fig.axes[0]
    assert ax.get_title() == "symmetry"
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"reused", "reused#2"}
    for name, want in zip(["reused", "reused#2"], refs["reused"], strict=True):
        steps = sorted(want)
        np.testing.assert_array_equal(lines[name].get_xdata(), steps)
        np.testing.assert_allclose(lines[name].get_ydata(), [np.median(list(want[s].values())) for s in steps],
                                   rtol=0, atol=TOL)
    proc = cli("plot", root / "reused", "-o", tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 0
    assert sum("holds 2 runs" in line for line in proc.stderr.splitlines()) == 1, proc.stderr


def test_named_runs_and_clashing_names_stay_apart(runs):
    root, refs = runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrajectoryWarning)
        df = load_trajectory({"x": root / "reused", "x#2": root / "stopped"})
    names = list(dict.fromkeys(df["run"]))
    assert sorted(names) == ["x", "x#2", "x#2#2", "x#3"]  # x#2 is the user's: the split runs take others
    assert_matches(layer_symmetry(df, "x"), refs["reused"][0])
    assert_matches(layer_symmetry(df, "x#3"), refs["reused"][1])
    assert_matches(layer_symmetry(df, "x#2"), refs["stopped"][0])
    assert_matches(layer_symmetry(df, "x#2#2"), refs["stopped"][1])
