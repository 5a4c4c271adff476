"""TRL's DPOTrainer under its default ``bf16=True`` (CPU autocast): the logged ``max_logit`` and
``entropy`` are float32 statistics of the q/k the attention function received, within 1e-5 of
float64 (issue 37: ``max_logit`` was rounded to bfloat16, 0.29% off).

Reference: the policy's own ``q_proj``/``k_proj`` outputs (bfloat16 under autocast), recorded by
forward hooks during the policy's training forwards only (its forward entered with gradients
enabled; not the reference passes under ``no_grad``, not the recompute of gradient
checkpointing in backward), rotated by the model's own ``apply_rotary_pos_emb`` with the
``position_embeddings`` the layer received (the tensors the attention function got), then
logits, softmax and entropy in float64 over the explicit causal + padding mask.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

from test_attention_forwards import _tokenizer  # noqa: E402
from test_attention_health_live import Records  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe.extraction import find_attention  # noqa: E402

HEADS, KV_HEADS = 4, 2


def _llama(vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, intermediate_size=64, vocab_size=vocab,
                                        initializer_range=0.4, pad_token_id=0, eos_token_id=2, bos_token_id=None))


class _TrainingForwards:
    """Per step, the q/k projections, rotary tables and 2D mask of each forward of ``root`` entered
    with gradients enabled; reference passes (``no_grad``) and backward recomputes are left out."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.step = 0
        self.active = False
        self.forwards: dict[int, list[dict]] = {}
        self.no_grad_forwards: dict[int, int] = {}
        root.register_forward_pre_hook(self._enter, with_kwargs=True)
        root.register_forward_hook(self._leave, always_call=True)
        for i, layer in enumerate(find_attention(root)):
            attn = layer.module
            attn.register_forward_pre_hook(self._rotary(i), with_kwargs=True)
            attn.q_proj.register_forward_hook(self._proj(i, "q"))
            attn.k_proj.register_forward_hook(self._proj(i, "k"))

    def _enter(self, module, args, kwargs):
        self.active = torch.is_grad_enabled()
        if self.active:
            self.forwards.setdefault(self.step, []).append({"mask": kwargs["attention_mask"].clone()})
        else:
            self.no_grad_forwards[self.step] = self.no_grad_forwards.get(self.step, 0) + 1

    def _leave(self, module, args, output):
        self.active = False

    def _rotary(self, i):
        def hook(module, args, kwargs):
            if self.active:
                self.forwards[self.step][-1][("rope", i)] = tuple(t.clone() for t in kwargs["position_embeddings"])
        return hook

    def _proj(self, i, name):
        def hook(module, args, output):
            if self.active:
                self.forwards[self.step][-1][(name, i)] = output.detach().clone()
        return hook


def _reference(forward: dict, layers: int) -> dict[tuple[int, int | None], tuple[float, float]]:
    """(layer, head) -> (max |l|, mean entropy over non-padding queries) in float64."""
    mask = forward["mask"].bool()
    B, n = mask.shape
    visible = mask[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()  # (B, 1, n, n)
    counted = visible & mask[:, None, :, None]
    out = {}
    for i in range(layers):
        D = forward[("q", i)].shape[-1] // HEADS
        q = forward[("q", i)].view(B, n, HEADS, D).transpose(1, 2)
        k = forward[("k", i)].view(B, n, KV_HEADS, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *forward[("rope", i)])  # the model's own op, its dtypes
        q, k = q.double(), k.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        logits = q @ k.transpose(-1, -2) * D ** -0.5
        head_max = torch.where(counted, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
        p = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
        row = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)  # (B, H, n)
        valid = mask[:, None, :].expand_as(row)
        head_ent = (row * valid).sum(dim=(0, 2)) / valid.sum(dim=(0, 2))
        out[(i, None)] = (float(head_max.max()), float(head_ent.mean()))
        for h in range(HEADS):
            out[(i, h)] = (float(head_max[h]), float(head_ent[h]))
    return out


@pytest.mark.parametrize("setup", ["ref_model", "peft"])
def test_dpo_default_bf16_statistics_are_float32(tmp_path, setup):
    """DPOConfig's defaults (bf16=True, gradient checkpointing on), 2 steps, every step due.
    ``ref_model``: full fine-tuning beside a reference model of the same class (other weights);
    ``peft``: a LoRA policy without ref_model, whose reference pass runs the watched modules
    under no_grad with the adapter disabled. Per layer and head, max_logit within 1e-5 relative
    and entropy within 1e-5 absolute of the float64 reference of the policy's training forward."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    words, tokenizer = _tokenizer()
    base = _llama(len(words) + 3, seed=0)
    g = torch.Generator().manual_seed(0)

    def sentence(n: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    data = Dataset.from_list([{"prompt": sentence(3), "chosen": sentence(2), "rejected": sentence(4)}
                              for _ in range(8)])
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, report_to="none",
                     use_cpu=True, save_strategy="no", logging_steps=100, disable_tqdm=True, learning_rate=0.05)
    assert args.bf16 is True and args.gradient_checkpointing is True  # TRL's defaults, left as they are
    ref_model, peft_config = None, None
    if setup == "ref_model":
        ref_model = _llama(len(words) + 3, seed=1)
    else:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    trainer = DPOTrainer(model=base, ref_model=ref_model, args=args, train_dataset=data, processing_class=tokenizer,
                         peft_config=peft_config)
    rec = _TrainingForwards(base)
    ref_calls: dict[int, int] = {}
    if ref_model is not None:
        ref_model.register_forward_pre_hook(
            lambda m, a: ref_calls.__setitem__(rec.step, ref_calls.get(rec.step, 0) + (not torch.is_grad_enabled())))

    class Step(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            rec.step = state.global_step + 1

    trainer.add_callback(Step())
    sink = Records()
    attn_probe.attach(trainer, every=1, attention_stats=True, per_head=True, sinks=[sink], metrics=("symmetry",),
                      log_dir=str(tmp_path / "tb"))
    trainer.train()

    got = {m: sink.values(m) for m in ("max_logit", "entropy")}
    assert sorted(got["max_logit"]) == [1, 2]
    for step in (1, 2):
        assert len(rec.forwards[step]) == 1, step  # the policy's one training forward (chosen + rejected)
        if setup == "ref_model":
            assert ref_calls[step] >= 1  # the reference model ran, under no_grad
        else:
            assert rec.no_grad_forwards[step] >= 1  # the watched modules' reference pass, adapter off
        forward = rec.forwards[step][0]
        assert forward[("q", 0)].dtype == torch.bfloat16  # the policy's forward ran under bf16 autocast
        want = _reference(forward, 2)
        assert set(got["max_logit"][step]) == set(want)
        for key, (m, e) in want.items():
            assert math.isfinite(m) and math.isfinite(e)
            assert got["max_logit"][step][key] == pytest.approx(m, rel=1e-5, abs=0), (step, key)
            assert got["entropy"][step][key] == pytest.approx(e, rel=0, abs=1e-5), (step, key)
        # the tolerance is finer than bfloat16 rounding: the values rounded to bf16 would fail it
        assert any(abs(float(torch.tensor(m).bfloat16()) - m) > 1e-5 * m for m, _ in want.values())
