"""The attention wrappers are harmless to what the probe does not watch, and a failure inside them
costs only attention statistics.

References: the same training without the probe (bit for bit), and the function an unwatched
attention class passes to transformers' ``get_interface`` (it must be the one called).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers import tiny_model  # noqa: E402
from test_attention_health_live import Records, _same_batch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import attn_probe  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

#: an attention class with no source file (exec'd), whose forward passes its own function,
#: not named eager_attention_forward, as get_interface's default
TEACHER_SOURCE = '''
from transformers.models.llama import modeling_llama
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

CALLS = []

def teacher_attention(module, query, key, value, attention_mask, **kwargs):
    CALLS.append(type(module).__name__)
    return modeling_llama.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

class TeacherAttention(modeling_llama.LlamaAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, teacher_attention)
        out, weights = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights
'''


def _teacher_namespace() -> dict:
    namespace = {"__name__": "attn_probe_test_teacher"}  # not in sys.modules, no source file
    exec(compile(TEACHER_SOURCE, "<teacher>", "exec"), namespace)
    return namespace


def _model(seed: int, layers: int = 2) -> LlamaForCausalLM:
    return tiny_model("llama", seed, impl="eager", num_hidden_layers=layers, intermediate_size=64, vocab_size=99,
                      max_position_embeddings=2048, initializer_range=0.4)


def _distil(tmp_path, probe: bool, namespace: dict) -> tuple[list[float], list[torch.Tensor], Records]:
    student, teacher = _model(0), _model(1, layers=1)
    for layer in teacher.model.layers:
        layer.self_attn.__class__ = namespace["TeacherAttention"]
    opt = torch.optim.SGD(student.parameters(), lr=1e-2)
    sink = Records()
    p = attn_probe.watch(student, optimizer=opt, every=1, attention_stats=True, sinks=[sink], metrics=("symmetry",),
                         log_dir=str(tmp_path / f"tb{probe}")) if probe else None
    ids, mask = _same_batch(2)
    losses, teacher_logits = [], []
    for _ in range(3):
        with torch.no_grad():
            target = teacher(input_ids=ids, attention_mask=mask).logits
        teacher_logits.append(target)
        logits = student(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.kl_div(logits.log_softmax(-1), target.softmax(-1), reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if p is not None:
        p.close()
    return losses, teacher_logits, sink


def test_unwatched_teacher_without_source_trains_beside_the_watched_student(tmp_path):
    """A teacher whose attention class has no source file and its own default function: with
    the student watched (eager, every step due) the teacher's forwards call that function, the
    run is bit-identical to the run without the probe, and the student's values are logged."""
    namespace = _teacher_namespace()
    plain = _distil(tmp_path, False, namespace)
    calls_plain = len(namespace["CALLS"])
    assert calls_plain == 3  # one layer, three teacher forwards
    watched = _distil(tmp_path, True, namespace)
    assert len(namespace["CALLS"]) == 2 * calls_plain  # the teacher's own function, each forward
    assert watched[0] == plain[0]
    for a, b in zip(watched[1], plain[1], strict=True):
        assert torch.equal(a, b)
    got = watched[2].values("max_logit")
    assert sorted(got) == [1, 2, 3] and all(v == v for v in got[3].values())  # finite, not NaN


FAILING_RUN = textwrap.dedent('''
    import json, sys, warnings
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import attn_probe
    import attn_probe.activations.statistics as stats

    probe_on = sys.argv[1] == "probe"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=99))
    model.set_attn_implementation("sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if probe_on:
        def broken(*args, **kwargs):
            raise RuntimeError("injected failure in the attention statistics")
        stats.logit_stats = broken
        probe = attn_probe.watch(model, optimizer=opt, every=2, attention_stats=True, sinks=[],
                                 metrics=("symmetry",), log_dir=sys.argv[2])
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    failures = probe.failures if probe_on else 0
    if probe_on:
        probe.close()
    torch.save(model.state_dict(), sys.argv[3])
    print(json.dumps({"losses": losses, "failures": failures}))
''')


def test_wrapper_failure_under_W_error_keeps_training_bit_identical(tmp_path):
    """``python -W error``: logit_stats raising on every due step (4 of 8) costs the attention
    values only: losses and weights equal a run without the probe bit for bit, one warning for
    the run (on stderr: -W error turns warnings into errors, safe_warn prints them), the due
    steps counted in probe.failures."""
    script = tmp_path / "run.py"
    script.write_text(FAILING_RUN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = {}
    for mode in ("plain", "probe"):
        proc = subprocess.run([sys.executable, "-W", "error", str(script), mode, str(tmp_path / "tb"),
                               str(tmp_path / f"{mode}.pt")], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = (json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr)
    assert out["probe"][0]["losses"] == out["plain"][0]["losses"]
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "probe.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert out["probe"][1].count("injected failure in the attention statistics") == 1
    assert out["probe"][0]["failures"] == 4
