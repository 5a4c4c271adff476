"""``restore_callback_states_from_checkpoint=True`` keeps the user's probe (issue 23 item 3).

transformers rebuilds stateful callbacks on resume as ``type(cb)(**saved_args)`` and moves the
result to the end of the callback list. Real Trainer runs: ten steps with a checkpoint at
step 5, resumed there with ``every=log_spaced(10)``, ``per_head=True`` and a custom sink; the
options (snapshots at 6, 8 and 10 with per-head rows), the sink (it receives the resumed
snapshots) and the callback object the user holds must survive, and the Trainer's loss must
still land in the probe's run although the callback now runs after TensorBoardCallback.
Checkpoints of earlier versions (saved args ``{}``) give the same.
"""

from __future__ import annotations

import functools
import json
import time

import pytest
from helpers import RandomTokens, make_args, tiny_bert
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer

import attn_probe
from attn_probe.integrations.transformers import AttnProbeCallback

make_args = functools.partial(make_args, report_to=["tensorboard"], save_strategy="steps", save_steps=5,
                              logging_steps=1, restore_callback_states_from_checkpoint=True)
SCHEDULE_AFTER_5 = [5, 6, 8, 10]  # log_spaced(10) fires at ..., 5, 6, 8, 10, 13, ...; 5 = resume, 10 = last


class ListSink:
    """A user's sink: the steps and per-head records it received."""

    def __init__(self):
        self.run, self.steps, self.heads = None, [], set()

    def start(self, run):
        self.run = run

    def log(self, snapshot):
        self.steps.append(snapshot.step)
        self.heads |= {(snapshot.step, r.head) for r in snapshot.records if r.head is not None}

    def finish(self):
        pass


def build(out, how, sink, every=None):
    options = dict(every=every or attn_probe.log_spaced(10), per_head=True, sinks=[sink])
    if how == "callbacks":
        callback = AttnProbeCallback(**options)
        trainer = Trainer(model=tiny_bert(), args=make_args(out, 10), train_dataset=RandomTokens(),
                          callbacks=[callback])
    else:
        trainer = Trainer(model=tiny_bert(), args=make_args(out, 10), train_dataset=RandomTokens())
        callback = attn_probe.attach(trainer, **options)
    return trainer, callback


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"run_header"' not in line]


def check_resumed(out, trainer, callback, sink):
    assert [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AttnProbeCallback)] == [callback]
    assert any(cb is callback for cb in trainer.callback_handler.callbacks)
    assert sink.steps == SCHEDULE_AFTER_5
    assert sink.run.per_head and sink.run.resume_step == 5
    assert {s for s, _ in sink.heads} == set(SCHEDULE_AFTER_5) and {h for _, h in sink.heads} == {0, 1, 2, 3}
    (run,) = (out / "runs").iterdir()  # the checkpoint's run, continued: no second run directory
    got = rows(run / "attn_probe.jsonl")
    layer = sorted({r["step"] for r in got if r["head"] is None})
    assert layer == [0, 1, 2, 3, 4] + SCHEDULE_AFTER_5
    assert sorted({r["step"] for r in got if r["head"] is not None}) == layer  # per-head rows kept and added
    ea = EventAccumulator(str(run), size_guidance={"scalars": 0})
    ea.Reload()
    # the Trainer's loss of the resumed session lands in the probe's run, beside the scores
    assert [e.step for e in ea.Scalars("train/loss") if e.step > 5] == [6, 7, 8, 9, 10]
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")][-4:] == SCHEDULE_AFTER_5


@pytest.mark.parametrize("how", ["attach", "callbacks"])
def test_restored_callback_keeps_options_and_sinks(tmp_path, how):
    out = tmp_path / "out"
    trainer, _ = build(out, how, ListSink())
    trainer.train()
    saved = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["AttnProbeCallback"]["args"]  # marked for the restore
    time.sleep(1.1)  # a TensorBoard run started now gets another default name than the first
    sink = ListSink()
    trainer, callback = build(out, how, sink)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-5"))
    check_resumed(out, trainer, callback, sink)


def test_checkpoint_of_an_earlier_version_with_empty_args(tmp_path):
    """Earlier versions saved ``args`` ``{}``: the single attached instance is taken all the same."""
    out = tmp_path / "out"
    trainer, _ = build(out, "attach", ListSink())
    trainer.train()
    state_file = out / "checkpoint-5" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["stateful_callbacks"]["AttnProbeCallback"]["args"] = {}
    state_file.write_text(json.dumps(state))
    time.sleep(1.1)
    sink = ListSink()
    trainer, callback = build(out, "attach", sink)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-5"))
    check_resumed(out, trainer, callback, sink)


def test_json_safe_options_keep_the_sink(tmp_path):
    """Options that survive JSON were rebuilt before, but a sink given beside them was lost."""
    out = tmp_path / "out"
    trainer, _ = build(out, "attach", ListSink(), every=2)
    trainer.train()
    time.sleep(1.1)
    sink = ListSink()
    trainer, callback = build(out, "attach", sink, every=2)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-5"))
    assert any(cb is callback for cb in trainer.callback_handler.callbacks)
    assert sink.steps == [5, 6, 8, 10] and sink.run.per_head
    # the saved args alone (no Trainer restoring states) still build a callback with those options
    args = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["stateful_callbacks"][
        "AttnProbeCallback"]["args"]
    rebuilt = AttnProbeCallback(**args)
    assert rebuilt is not callback and rebuilt.config.per_head is True and rebuilt.config.every == 2

