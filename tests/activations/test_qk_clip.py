"""The QK-clip dry run (issue 38 item 4): MuonClip's ``S_max`` (the signed max logit),
``qk_clip_scale = min(1, tau / S_max)`` and ``heads_over_tau``.

References are computed here: explicit float64 logits from explicit q/k (and, live, from each
attention module's own q/k projections and Llama's own rotary function), then the clip factor
and the count by hand, head by head.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from attn_probe import watch  # noqa: E402
from attn_probe.activations.statistics import logit_stats  # noqa: E402
from attn_probe.extraction import find_attention  # noqa: E402
from attn_probe.live.alerts import AlertRule  # noqa: E402
from attn_probe.live.stages.qk_clip import clip_tables  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402

TAU = 100.0


def hand_scale(s: float, tau: float) -> float:
    """MuonClip's gamma = min(1, tau / S_max), written out case by case."""
    if math.isnan(s):
        return math.nan
    return 1.0 if s <= tau else tau / s


def test_signed_max_scale_and_count_match_explicit_logits():
    """Four query heads on two key heads (GQA), causal: head 0 has large positive logits (clipped),
    head 1 large negative ones (large max |l|, S_max < 0: not clipped), heads 2 and 3 small ones.
    The signed max, the scale and the count equal the hand computation from float64 logits."""
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, n, D = 2, 4, 2, 7, 8
    u = torch.randn(D, generator=gen, dtype=torch.float64)
    q = torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) * 0.1
    k = torch.randn(B, Hkv, n, D, generator=gen, dtype=torch.float64) * 0.1
    k[:, 0] += 4 * u  # key head 0 serves query heads 0 and 1
    q[:, 0] += 30 * u
    q[:, 1] -= 30 * u
    scaling = D ** -0.5

    def causal(r0, r1):
        return (torch.arange(n)[None] <= torch.arange(r0, r1)[:, None])[None, None], None

    top, _, _, signed = logit_stats(q, k, scaling, causal)
    logits = torch.einsum("bhqd,bhkd->bhqk", q * scaling, k.repeat_interleave(H // Hkv, dim=1))
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    ref_signed = logits.masked_fill(~visible, -math.inf).amax(dim=(0, 2, 3))
    ref_abs = logits.abs().masked_fill(~visible, -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(signed, ref_signed, rtol=1e-12, atol=0)
    torch.testing.assert_close(top, ref_abs, rtol=1e-12, atol=0)
    s = ref_signed.tolist()
    assert s[0] > TAU and s[1] < 0 < ref_abs[1] - TAU and max(s[2:]) < TAU  # the case the test is about

    column = torch.cat([ref_signed.max()[None], signed]).numpy()
    (names, table), (over_name, over) = clip_tables(column, TAU, per_head=True)
    assert names == ("max_logit_signed", "qk_clip_scale") and over_name == ("heads_over_tau",)
    want_scales = [hand_scale(v, TAU) for v in s]
    assert table[1, 1:].tolist() == pytest.approx(want_scales, rel=1e-12)
    assert want_scales[0] == pytest.approx(TAU / s[0]) and want_scales[1:] == [1.0, 1.0, 1.0]
    assert table[1, 0] == pytest.approx(min(want_scales), rel=1e-12)  # the layer: the strictest clip
    assert table[0, 0] == pytest.approx(max(s), rel=1e-12)
    assert over.shape == (1, 1) and over[0, 0] == sum(v > TAU for v in s) == 1
    # without per-head values: the layer columns only, the count still over every head
    (_, layer_only), (_, over_layer) = clip_tables(column, TAU, per_head=False)
    assert layer_only.shape == (2, 1) and over_layer[0, 0] == 1


def test_not_measured_heads_are_nan_and_never_counted():
    """A head where nothing was counted (``-inf`` in the accumulators) is NaN and left out of the layer."""
    inf = math.inf
    column = torch.tensor([250.0, -inf, 250.0, -3.0]).numpy()
    (_, table), (_, over) = clip_tables(column, TAU, per_head=True)
    assert math.isnan(table[0, 1]) and math.isnan(table[1, 1])
    assert table[1, 2] == pytest.approx(0.4) and table[1, 3] == 1.0 and table[1, 0] == pytest.approx(0.4)
    assert over[0, 0] == 1
    (_, table), (_, over) = clip_tables(torch.tensor([-inf, -inf, -inf]).numpy(), TAU, per_head=True)
    assert math.isnan(table[0, 0]) and math.isnan(table[1, 0]) and math.isnan(over[0, 0])


def test_a_nan_head_makes_its_layer_nan():
    """Issue 44, finding 12: a NaN logit in one head is not "nothing counted". The layer's signed max
    (max over heads), its scale (min) and its count are NaN, never the other heads' values."""
    from attn_probe.live.stages.qk_clip import signed_columns

    (column,) = signed_columns(torch.tensor([250.0, math.nan, -3.0]).numpy(), [3])
    assert math.isnan(column[0]) and column[1] == 250.0
    (_, table), (_, over) = clip_tables(column, TAU, per_head=True)
    assert math.isnan(table[0, 0]) and math.isnan(table[1, 0]) and math.isnan(over[0, 0])
    assert table[1, 1] == pytest.approx(0.4) and math.isnan(table[1, 2]) and table[1, 3] == 1.0


def test_a_nan_in_one_head_fires_the_dry_run_rules_and_is_logged_as_nan(tmp_path):
    """Issue 44, finding 12: a model whose attention gives NaN logits in one head (head 1 of layer 0:
    its query rows of ``q_proj`` are NaN). ``max_logit`` fired, but the rules on ``max_logit_signed``,
    ``qk_clip_scale`` and ``heads_over_tau`` never did, and layer 0's rows of those metrics held the
    other heads' values. Now each rule fires on layer 0 and the trajectory file's layer rows are null
    (NaN as the format writes it); the other heads of layer 0 keep their finite values."""
    import json

    from attn_probe.formats.trajectory import TRAJECTORY_FILENAME

    model = tiny_model("llama", impl="sdpa", vocab_size=99, max_position_embeddings=64).double()
    attn = find_attention(model)[0]
    head_dim = attn.head_dim
    with torch.no_grad():
        attn.module.q_proj.weight[head_dim:2 * head_dim] = math.nan  # query head 1 of layer 0
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    metrics = ("max_logit", "max_logit_signed", "qk_clip_scale", "heads_over_tau")
    alerts = []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = watch(model, optimizer=opt, every=1, attention_stats=True, per_head=True, log_dir=str(tmp_path / "run"),
                  alerts=[AlertRule(m, above=1e300, layers=[attn.layer]) for m in metrics],
                  alert_callback=alerts.append, random_range=False, background=False)
    model(ids, labels=ids).loss.backward()
    opt.step()
    probe.close()
    fired = {(a.metric, a.head) for a in alerts if a.layer == attn.layer}
    assert fired == {(m, None) for m in metrics}
    assert all(math.isnan(a.value) for a in alerts)
    rows = [json.loads(line) for line in (tmp_path / "run" / TRAJECTORY_FILENAME).read_text().splitlines()]
    got = {(r["head"], r["metric"]): r["value"] for r in rows
           if r["step"] == 1 and r["layer"] == attn.layer and r["metric"] in metrics}
    for m in metrics:
        assert got[(None, m)] is None, m  # NaN, written as null
    for m in ("max_logit_signed", "qk_clip_scale"):
        assert got[(1, m)] is None
        assert all(isinstance(got[(h, m)], float) for h in (0, 2, 3))


def signed_reference(model, ids) -> dict[int, list[float]]:
    """Layer -> per-head signed max logit from the modules' own q/k projections and rotary
    function (causal, every token counted), float64."""
    layers = find_attention(model)
    seen, hooks = {}, []
    for i, layer in enumerate(layers):
        def hook(module, args, kwargs, i=i):
            seen[i] = (args[0] if args else kwargs["hidden_states"], kwargs.get("position_embeddings"))
        hooks.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    B, n = ids.shape
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    out = {}
    for i, layer in enumerate(layers):
        x, rotary = seen[i]
        attn, H, Hkv, D = layer.module, layer.num_heads, layer.num_kv_heads, layer.head_dim
        with torch.no_grad():
            q = attn.q_proj(x).view(B, n, H, D).transpose(1, 2)
            k = attn.k_proj(x).view(B, n, Hkv, D).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *rotary)
            logits = q @ k.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2) * D ** -0.5
        out[layer.layer] = logits.masked_fill(~visible, -math.inf).amax(dim=(0, 2, 3)).tolist()
    return out


def test_live_run_logs_the_dry_run_and_an_alert_on_heads_over_tau_fires(tmp_path):
    """A plain loop with ``attention_stats=True, per_head=True``: the logged ``max_logit_signed`` equals
    the reference from the model's own projections, ``qk_clip_scale`` and ``heads_over_tau`` equal the
    hand computation from the logged signed max, and a rule ``heads_over_tau above 0`` fires where a
    layer has a head over tau (tau chosen between the heads' values, so some are over and some not)."""
    import copy

    model = tiny_model("llama", impl="sdpa", vocab_size=99, max_position_embeddings=64, initializer_range=0.4).double()
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    first = signed_reference(model, ids)
    tau = float(sorted(v for heads in first.values() for v in heads)[len(first) * 4 // 2])  # the median head
    with pytest.raises(ValueError, match="heads_over_tau is a per-layer count"):
        watch(model, every=1, attention_stats=True, per_head=True, log_dir=str(tmp_path / "refused"),
              alerts=[AlertRule("heads_over_tau", above=0, heads=True)], random_range=False)
    with pytest.raises(ValueError, match="qk_clip_tau must be a finite number > 0"):
        watch(model, every=1, attention_stats=True, qk_clip_tau=0, log_dir=str(tmp_path / "refused2"))

    snapshots, alerts, before, configs = [], [], {}, []

    class Keep:
        def start(self, run):
            configs.append(run.config)

        def log(self, snapshot):
            snapshots.append(snapshot)

        def finish(self):
            pass

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    probe = watch(model, optimizer=opt, every=1, attention_stats=True, per_head=True, qk_clip_tau=tau,
                  alerts=[AlertRule("heads_over_tau", above=0)], alert_callback=alerts.append,
                  sinks=[Keep()], log_dir=str(tmp_path / "run"), random_range=False, background=False)
    for step in (1, 2):
        before[step] = copy.deepcopy(model)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    assert configs[0]["qk_clip_tau"] == tau  # recorded in the run header

    measured = {s.step: s for s in snapshots if any(r.metric == "max_logit_signed" for r in s.records)}
    assert measured, "no step logged the dry run"
    checked_over = False
    for step, snap in measured.items():
        want = signed_reference(before[step], ids)
        values = {(r.layer, r.head, r.metric): r.value for r in snap.records}
        for layer, heads in want.items():
            got = [values[(layer, h, "max_logit_signed")] for h in range(4)]
            assert got == pytest.approx(heads, rel=1e-9, abs=1e-12)
            assert values[(layer, None, "max_logit_signed")] == pytest.approx(max(heads), rel=1e-9)
            for h in range(4):  # from the logged statistics, by hand
                assert values[(layer, h, "qk_clip_scale")] == pytest.approx(hand_scale(got[h], tau), rel=1e-12)
                assert got[h] <= values[(layer, h, "max_logit")] * (1 + 1e-12)  # max l <= max |l|
            assert values[(layer, None, "qk_clip_scale")] == pytest.approx(min(hand_scale(g, tau) for g in got))
            count = sum(g > tau for g in got)
            assert values[(layer, None, "heads_over_tau")] == count
            assert (layer, 0, "heads_over_tau") not in values  # a per-layer count only
            fired = [a for a in alerts if a.step == step and a.layer == layer]
            if count > 0 and not any(a.step < step and a.layer == layer for a in alerts):
                checked_over = True
                assert [a.metric for a in fired] == ["heads_over_tau"] and fired[0].value == count
                assert fired[0].head is None
            elif count == 0:
                assert fired == []
    assert checked_over, "no layer had a head over tau: the alert was not exercised"
    assert 0 < sum(v > tau for heads in first.values() for v in heads) < 4 * len(first)
