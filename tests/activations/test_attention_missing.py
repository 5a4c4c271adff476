"""Attention statistics are never silently absent: a switched implementation is followed, and an
armed step that measured nothing is warned about once (with its cause) and counted at close.

References: :func:`reference` of test_attention_health_live (the model's own projections, its
rotary function and explicit masks, in float64) on the weights each step ran with.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import attn_probe  # noqa: E402
from tests.activations.test_attention_health_live import TOL, Records, _llama, _same_batch, reference  # noqa: E402


def _train(model, probe_kwargs, tmp_path, steps, before_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, sinks=[sink],
                             log_dir=str(tmp_path / "tb"), **probe_kwargs)
    ids, mask = _same_batch(2)
    weights = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            if before_step is not None:
                before_step(step)
            weights[step] = copy.deepcopy(model.state_dict())
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    return sink, weights, [str(w.message) for w in caught if "attn_probe" in str(w.message)], (ids, mask)


def test_an_implementation_switched_after_attach_is_followed(tmp_path):
    """sdpa at attach, eager from step 3 on (``set_attn_implementation``): steps 3 and 4 still get
    max_logit and entropy, equal to the reference of their weights (none on 7ce385c)."""
    model = _llama()

    def switch(step):
        if step == 3:
            model.set_attn_implementation("eager")

    sink, weights, messages, (ids, mask) = _train(model, {"per_head": True}, tmp_path, 4, switch)
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    assert sorted(got_max) == [1, 2, 3, 4], messages
    for step in (2, 3, 4):
        ref_model = _llama()
        ref_model.load_state_dict(weights[step])
        want = reference(ref_model, ids, mask)
        for key in [(0, None), (1, None), (0, 2), (1, 3)]:
            assert got_max[step][key] == pytest.approx(want[key][0], rel=TOL, abs=TOL), (step, key)
            assert got_ent[step][key] == pytest.approx(want[key][1], rel=TOL, abs=TOL), (step, key)
    assert not [m for m in messages if "not measured" in m]


def test_a_switch_to_an_unmeasured_implementation_is_warned_once_and_counted(tmp_path):
    """A switch to an implementation the probe does not measure (a custom registered one): the
    rows stop, with one warning naming the cause and the remedy, and the count at close."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("attn_probe_test_custom", sdpa_attention_forward)
    model = _llama()

    def switch(step):
        if step == 3:
            model.set_attn_implementation("attn_probe_test_custom")

    sink, _, messages, _ = _train(model, {}, tmp_path, 5, switch)
    assert sorted(sink.values("max_logit")) == [1, 2]
    assert sorted(sink.values("symmetry")) == [0, 1, 2, 3, 4, 5]  # the weight metrics go on
    first = [m for m in messages if "were not measured at step 3" in m]
    assert len(first) == 1 and "changed after the probe attached" in first[0] and "attn_probe_test_custom" in first[0]
    summary = [m for m in messages if "missing for some layers at 3 due steps" in m]
    assert len(summary) == 1 and "steps 3, 4, 5" in summary[0]


def test_an_armed_step_without_training_forwards_is_warned(tmp_path):
    """Steps whose forwards all run under no_grad (the loss from somewhere else): nothing is
    measured, and that is said once with the likely causes, not left silent."""
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, sinks=[sink],
                             log_dir=str(tmp_path / "tb"))
    ids, mask = _same_batch(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
            sum(p.sum() for p in model.parameters()).backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    messages = [str(w.message) for w in caught]
    assert sink.values("max_logit") == {}
    first = [m for m in messages if "were not measured at step 1 for 2 of 2 layers" in m]
    assert len(first) == 1 and "torch.compile" in first[0] and "no_grad" in first[0]


def _compiled_run(tmp_path, name, reset_before_attach, impl="sdpa"):
    """An earlier compiled model of the same class trained a step in this process, then a watched
    one, compiled (backend eager), every step due: the sink, the attn_probe warnings, the weights
    each step began with, the batch."""
    torch._dynamo.reset()
    ids, mask = _same_batch(2)
    earlier = _llama()
    earlier.set_attn_implementation(impl)
    torch.compile(earlier, backend="eager")(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    if reset_before_attach:
        torch.compiler.reset()  # the printed remedy
    model = _llama()
    model.set_attn_implementation(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = Records()
    weights = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, per_head=True, sinks=[sink],
                                 metrics=("symmetry",), log_dir=str(tmp_path / name))
        run = torch.compile(model, backend="eager")
        for step in (1, 2):
            weights[step] = copy.deepcopy(model.state_dict())
            run(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    torch._dynamo.reset()
    return sink, [str(w.message) for w in caught if "attn_probe" in str(w.message)], weights, (ids, mask)


def _assert_reference(sink, weights, ids, mask) -> None:
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    assert sorted(got_max) == [1, 2]
    for step in (1, 2):
        ref_model = _llama()
        ref_model.load_state_dict(weights[step])
        want = reference(ref_model, ids, mask)
        assert set(got_max[step]) == set(want) and len(want) == 2 * 5
        for key, (m, e) in want.items():
            assert got_max[step][key] == pytest.approx(m, rel=TOL, abs=TOL), (step, key)
            assert got_ent[step][key] == pytest.approx(e, rel=TOL, abs=TOL), (step, key)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_compile_after_an_earlier_compile_in_the_process(tmp_path, impl):
    """A model of the same class compiled and trained before the probe attached, then a watched one
    compiled: every step's per-layer and per-head max_logit and entropy equal the float64
    reference of its weights, with no 'not measured' warning (0 rows and a warning before: the
    frame compiled before attach was reused without the probe's wrapper; the shadowed
    ``get_interface`` of ``ALL_ATTENTION_FUNCTIONS`` now fails its guard). At close the shadow is
    gone again."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sink, messages, weights, (ids, mask) = _compiled_run(tmp_path, "stale", reset_before_attach=False, impl=impl)
    assert not [m for m in messages if "not measured" in m], messages
    _assert_reference(sink, weights, ids, mask)
    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS)


def test_compiled_code_from_before_attach_after_a_reset(tmp_path):
    """The remedy the warning still prints for code compiled before attach that the probe cannot
    reach (torch.compiler.reset() before attaching) gives the reference values too."""
    sink, messages, weights, (ids, mask) = _compiled_run(tmp_path, "reset", reset_before_attach=True)
    assert not [m for m in messages if "not measured" in m], messages
    _assert_reference(sink, weights, ids, mask)


def test_trainer_torch_compile_after_an_earlier_compiled_run(tmp_path):
    """The case as found (issue 37): TrainingArguments(torch_compile=True) after an earlier compiled
    Trainer run in the same process gave 0 of the statistic rows, no warning. Now every step's
    per-head rows equal the float64 reference on its weights and batches."""
    from transformers import Trainer

    from tests.activations.test_attention_health_live import Data, StepRecorder
    from tests.helpers import make_args

    torch._dynamo.reset()
    compiled = {"torch_compile": True, "torch_compile_backend": "eager"}
    args = make_args(tmp_path / "earlier", 1, per_device_train_batch_size=2, logging_steps=100, **compiled)
    Trainer(model=_llama(), args=args, train_dataset=Data()).train()
    model = _llama()
    recorder = StepRecorder(model)
    sink = Records()
    probe_cb = attn_probe.AttnProbeCallback(every=1, attention_stats=True, per_head=True, sinks=[sink],
                                            metrics=("symmetry",), log_dir=str(tmp_path / "tb"))
    recorder.probe_callback = probe_cb
    args = make_args(tmp_path / "watched", 2, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=100,
                     **compiled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=args, train_dataset=Data(), callbacks=[recorder, probe_cb]).train()
    torch._dynamo.reset()
    assert not [str(w.message) for w in caught if "not measured" in str(w.message)]
    assert recorder.armed == {1: [True], 2: [True]}
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    assert sorted(got_max) == [1, 2]
    for step in (1, 2):
        ref_model = _llama()
        ref_model.load_state_dict(recorder.weights[step])
        (ids, mask), = recorder.batches[step]
        want = reference(ref_model, ids, mask)
        assert set(got_max[step]) == set(want)
        for key, (m, e) in want.items():
            assert got_max[step][key] == pytest.approx(m, rel=TOL, abs=TOL), (step, key)
            assert got_ent[step][key] == pytest.approx(e, rel=TOL, abs=TOL), (step, key)


@pytest.mark.parametrize("failing", [1, None], ids=["one failed call", "every call fails"])
def test_a_failed_measurement_is_one_warning_carrying_its_count(tmp_path, monkeypatch, recwarn, failing):
    """Issue 44 item 11: measuring inside the attention wrapper raises (here the statistics function
    the wrapper calls, for the first call only or for every call of 4 due steps). One warning for the
    whole run, with the count of the step's failed calls and the layers they cost; not a failure
    warning plus a "not measured" warning plus a summary at close (three on 70bdcc9)."""
    from attn_probe.activations import statistics

    real, calls = statistics.logit_stats, []

    def raising(*args, **kwargs):
        calls.append(1)
        if failing is None or len(calls) <= failing:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(statistics, "logit_stats", raising)
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, sinks=[sink],
                             log_dir=str(tmp_path / "tb"))
    ids, mask = _same_batch(2)
    warnings.simplefilter("always")
    for _ in range(4):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    ours = [str(w.message) for w in recwarn if "attn_probe" in str(w.message)]
    assert len(calls) == 8  # 2 layers x 4 steps reached the wrapper
    assert len(ours) == 1, ours
    if failing == 1:
        assert "skipped at step 1: 1 failed call in 1 of 2 layers (model.layers.0.self_attn)" in ours[0], ours[0]
        assert "injected failure" in ours[0] and "1 of them are not logged" in ours[0]
        assert probe.failures == 1
        logged = sink.values("max_logit")
        assert sorted(logged) == [1, 2, 3, 4]
        measured = {step: {key for key, value in values.items() if not math.isnan(value)} for step, values in logged.items()}
        assert measured[1] == {(1, None)} and measured[4] == {(0, None), (1, None)}  # layer 0: NaN at step 1 only
    else:
        assert "skipped at step 1: 2 failed calls in 2 of 2 layers" in ours[0], ours[0]
        assert probe.failures == 4  # counted once per step it happened in
        assert sink.values("max_logit") == {}
        assert sorted(sink.values("symmetry")) == [0, 1, 2, 3, 4]  # the weight metrics go on
    # those counted failures do not silence the first failure reported elsewhere (a snapshot's)
    recwarn.clear()
    probe.failure_log.report("a snapshot", RuntimeError("later"))
    assert [w for w in recwarn if "a snapshot failed" in str(w.message)]
