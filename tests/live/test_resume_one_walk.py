"""Issue 44 item 3: a resume reads its trajectory once. The cut back to the resume step and the
alert replay share one walk of the file (the cut's, :func:`attn_probe.formats.cutting.cut_run`
``watch=``), and the cut needs no second walk unless it must rewrite the file. The replay read
on that walk equals the replay read back from the cut file (the independent reference: the
former second read, :class:`attn_probe.formats.run_rows.RunRows` over the file after the cut)."""

from __future__ import annotations

import json
import shutil

import pytest

from attn_probe.formats import cutting, run_rows
from attn_probe.formats.cutting import cut_run
from attn_probe.formats.trajectory import encode_header
from attn_probe.isolation import Failures
from attn_probe.live.alerts import AlertRule
from attn_probe.live.stages.alerting import Alerting

RULES = [AlertRule("frobenius_norm", growth=2.0, within=8), AlertRule("max_logit", above=30.0)]


def _rows(step: int, scale: float) -> bytes:
    out = []
    for layer in range(2):
        for metric, value in (
            ("frobenius_norm", scale * 2 ** (step / 7.5) * (1 + layer)),
            ("max_logit", 10.0 + step * (1 + layer)),
            ("symmetry", 0.1),
        ):
            out.append(
                json.dumps(
                    {
                        "step": step,
                        "wall_time": 1.0,
                        "group": "self",
                        "layer": layer,
                        "head": None,
                        "metric": metric,
                        "value": value,
                    }
                )
            )
    return ("\n".join(out) + "\n").encode()


def _file(path, parts) -> None:
    """``parts``: ``(run id or None, resumed, steps, scale)``, a header (unless the id is ``None``)
    then the rows of those steps, in order."""
    with open(path, "wb") as fh:
        for run_id, resumed, steps, scale in parts:
            if run_id is not None:
                fh.write(encode_header(run_id, steps[0], wall_time=1.0, resumed=resumed))
            for step in steps:
                fh.write(_rows(step, scale))


def _alerting() -> Alerting:
    return Alerting(RULES, stop_on_alert=False, callback=None, is_main_process=True, failures=Failures())


def _after(alerting: Alerting, first: int) -> list[tuple]:
    """What the rules fire over steps ``first..first+15`` of a run growing on: tells their states apart."""
    fired = []
    for step in range(first, first + 16):
        rows = [
            {
                "group": "self",
                "layer": layer,
                "head": None,
                "frobenius_norm": 2 ** (step / 7.5) * (1 + layer),
                "max_logit": 10.0 + step * (1 + layer),
            }
            for layer in range(2)
        ]
        fired += [(a.step, a.layer, a.metric) for a in alerting.main.evaluate(step, rows)]
        fired += [(a.step, a.layer, a.metric) for a in alerting.every_rank.evaluate(step, rows)]
    return fired


@pytest.fixture
def monitor_walks(monkeypatch):
    """How many times a file is walked (each walk is one call of the cut's ``pieces``)."""
    count = [0]
    real = cutting.pieces

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cutting, "pieces", counted)
    monkeypatch.setattr(run_rows, "pieces", counted)
    return count


FILES = {
    # one run, resumed from its checkpoint at 12 after it ran to 17
    "one run": ([("a", False, range(0, 18), 1.0)], None),
    # the same id opened twice (two runs), another run between: the latest "a" is resumed
    "id reopened": (
        [("a", False, range(0, 10), 3.0), ("b", False, range(0, 6), 1.0), ("a", False, range(0, 18), 1.0)],
        None,
    ),
    # the run resumed once already (a resumed header continues it), then interrupted again
    "resumed twice": ([("a", False, range(0, 9), 1.0), ("a", True, range(9, 18), 1.0)], None),
    # another run's rows after the resumed run's: the file is rewritten (a second walk, replay read back)
    "rewritten": ([("a", False, range(0, 18), 1.0), ("b", False, range(0, 4), 1.0)], "a"),
    # rows before run headers, then a run: the last run is resumed
    "legacy first": ([(None, False, range(0, 5), 1.0), ("a", False, range(0, 18), 1.0)], None),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_the_replay_on_the_cut_walk_equals_the_replay_read_back(tmp_path, name, monitor_walks):
    parts, given = FILES[name]
    path = tmp_path / "attn_probe.jsonl"
    _file(path, parts)
    reference_path = tmp_path / "reference.jsonl"
    shutil.copyfile(path, reference_path)
    resume = 12

    # the reference: the cut, then the rules replayed from the cut file read back
    ref_cut = cut_run(reference_path, resume, given)
    reference = _alerting()
    ref_steps = reference.restore(str(reference_path), ref_cut.run_id)

    alerting = _alerting()
    watch = alerting.resume_watch(resume)
    monitor_walks[0] = 0
    cut = cut_run(path, resume, given, watch=watch)
    watch.finish(str(path), cut, cut.run_id)
    steps = alerting.restore(str(path), cut.run_id)

    assert path.read_bytes() == reference_path.read_bytes()
    assert (cut.dropped, cut.run_id) == (ref_cut.dropped, ref_cut.run_id)
    assert steps == ref_steps == 12
    assert _after(alerting, resume) == _after(reference, resume)
    # one walk for the cut and the replay; a rewritten file two for the cut and one for the replay
    assert monitor_walks[0] == (3 if name == "rewritten" else 1)


def test_a_new_run_id_needs_no_replay(tmp_path, monitor_walks):
    path = tmp_path / "attn_probe.jsonl"
    _file(path, [("a", False, range(0, 18), 1.0)])
    alerting = _alerting()
    watch = alerting.resume_watch(12)
    cut = cut_run(path, 12, "new", otherwise="none", watch=watch)
    watch.finish(str(path), cut, "new")
    assert alerting.restore(str(path), "new") == 0
    assert monitor_walks[0] == 1


def test_a_probe_resumed_next_to_its_trajectory_walks_it_once(tmp_path, monitor_walks):
    """The whole resume of a probe (the cut and the alert replay) reads the file once, and fires as
    the uninterrupted run (the reference of tests/live/test_alerts_resume.py)."""
    pytest.importorskip("transformers")
    from tests.helpers import tiny_llama
    from tests.live.test_alerts_resume import _run

    model = tiny_llama()
    _, checkpoint = _run(model, tmp_path, 0, 11, save_at=8)
    model = tiny_llama()
    model.load_state_dict(checkpoint)
    monitor_walks[0] = 0
    fired, _ = _run(model, tmp_path, 8, 12)
    assert monitor_walks[0] == 1
    assert fired == [(8, 0, None, "frobenius_norm"), (8, 1, None, "frobenius_norm")]  # as uninterrupted
