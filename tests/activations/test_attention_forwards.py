"""Only the forwards that produce the update are measured (docs/scores.md, "Which forwards count").

References: the model's own q/k projections (``reference`` of test_attention_health_live) on
the step's weights and the batches of its training forwards only, recorded by a hook beside
the probe; runs without gradient checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from test_attention_health_live import TOL, Data, Records, _llama, _same_batch, reference  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe import AttnProbeCallback  # noqa: E402
from attn_probe.activations.statistics import AttentionCapture  # noqa: E402
from attn_probe.extraction import find_attention  # noqa: E402
from tests.helpers import make_args  # noqa: E402


def _check(got: dict, model, ids, mask, step: int) -> None:
    want = reference(model, ids, mask)
    assert set(got["max_logit"][step]) == set(want)
    for key, (m, e) in want.items():
        assert got["max_logit"][step][key] == pytest.approx(m, rel=TOL, abs=TOL), (step, key)
        assert got["entropy"][step][key] == pytest.approx(e, rel=TOL, abs=TOL), (step, key)


def test_no_grad_generate_and_eval_forwards_inside_a_due_step_are_not_measured(tmp_path):
    """Plain loop, every step due: before each training forward a generate(), an eval-mode
    no_grad forward on another batch and an inference_mode forward; the logged values are those
    of the training forward alone."""
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, per_head=True, sinks=[sink],
                             metrics=("symmetry",), log_dir=str(tmp_path / "tb"))
    ids, mask = _same_batch(2)
    other = torch.randint(1, 99, (3, 5), generator=torch.Generator().manual_seed(7))
    weights = {}
    for step in range(1, 3):
        weights[step] = copy.deepcopy(model.state_dict())
        model.eval()
        model.generate(other, attention_mask=torch.ones_like(other), max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
        with torch.no_grad():
            model(other)
        with torch.inference_mode():
            model(other)
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    got = {m: sink.values(m) for m in ("max_logit", "entropy")}
    for step in (1, 2):
        ref = _llama()
        ref.load_state_dict(weights[step])
        _check(got, ref, ids, mask, step)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_measures_the_training_forward_once(tmp_path, reentrant):
    """Trainer with gradient checkpointing (use_reentrant True: the block's training forward runs
    under no_grad; False): the logged values equal the reference on the step's batches, the
    recompute in backward is not counted (token counts would double the entropy's weight)."""

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.weights, self.batches, self.current = {}, {}, 0

        def on_step_begin(self, args, state, control, **kw):
            self.current = state.global_step + 1
            self.weights[self.current] = copy.deepcopy(model.state_dict())

    model = _llama()
    rec = Recorder()

    def hook(module, args, kwargs):
        if torch.is_grad_enabled():
            rec.batches.setdefault(rec.current, []).append((kwargs["input_ids"].clone(),
                                                            kwargs["attention_mask"].clone()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    sink = Records()
    cb = AttnProbeCallback(every=2, attention_stats=True, per_head=True, sinks=[sink], metrics=("symmetry",),
                           log_dir=str(tmp_path / "tb"))
    args = make_args(tmp_path, 2, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2,
                     logging_steps=100, gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    Trainer(model=model, args=args, train_dataset=Data(), callbacks=[rec, cb]).train()
    got = {m: sink.values(m) for m in ("max_logit", "entropy")}
    assert sorted(got["max_logit"]) == [2] and len(rec.batches[2]) == 2
    ref = _llama()
    ref.load_state_dict(rec.weights[2])
    _check(got, ref, torch.cat([b[0] for b in rec.batches[2]]), torch.cat([b[1] for b in rec.batches[2]]), 2)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a b c d e f g h i j k l m n o p".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return words, PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                          eos_token="[EOS]")


@pytest.mark.parametrize("mode", ["disable_adapter", "ref_adapter"])
def test_trl_dpo_reference_pass_is_not_measured(tmp_path, mode):
    """TRL DPOTrainer, PEFT LoRA policy (adapters initialised non-zero so that the reference
    differs from the policy), no ref_model: the reference pass (no_grad, adapter disabled, or
    TRL's "ref" adapter copy) leaves the logged values those of the policy's training forward."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    words, tokenizer = _tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=len(words) + 3,
                                        initializer_range=0.4, pad_token_id=0, eos_token_id=2, bos_token_id=None))
    g = torch.Generator().manual_seed(0)

    def sentence(n: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    data = Dataset.from_list([{"prompt": sentence(3), "chosen": sentence(2), "rejected": sentence(3)}
                              for _ in range(8)])
    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora) if mode == "ref_adapter" else base
    record: dict[int, list] = {}
    weights: dict[int, dict] = {}
    current = [0]

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            current[0] = state.global_step + 1
            weights[current[0]] = copy.deepcopy(model.state_dict())

    def hook(module, args, kwargs):
        if torch.is_grad_enabled():
            record.setdefault(current[0], []).append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone()))

    base.register_forward_pre_hook(hook, with_kwargs=True)
    sink = Records()
    cb = AttnProbeCallback(every=1, attention_stats=True, per_head=True, sinks=[sink], metrics=("symmetry",),
                           log_dir=str(tmp_path / "tb"))
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, report_to="none",
                     use_cpu=True, save_strategy="no", logging_steps=100, disable_tqdm=True, learning_rate=0.05,
                     bf16=False)  # TRL defaults to bf16 autocast; the reference runs without it
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         peft_config=lora if mode == "disable_adapter" else None, callbacks=[Steps(), cb])
    if mode == "ref_adapter":
        assert "ref" in trainer.model.peft_config
    trainer.train()
    got = {m: sink.values(m) for m in ("max_logit", "entropy")}
    assert sorted(got["max_logit"]) == [1, 2]
    base_copy = LlamaForCausalLM(base.config)
    policy = get_peft_model(base_copy, lora)  # the policy alone: adapter "default", no "ref"
    for step in (1, 2):
        assert len(record[step]) == 1  # one training forward per step; the reference pass runs under no_grad
        missing = policy.load_state_dict(weights[step], strict=False).missing_keys
        assert missing == []
        ids, mask = record[step][0]
        # the reference: an eager measurement of that forward alone on a fresh policy (adapter on)
        capture = AttentionCapture(base_copy, find_attention(base_copy), training_only=False)
        capture.arm()
        with torch.no_grad():
            base_copy.eval()(input_ids=ids, attention_mask=mask)
        capture.disarm()
        tables = capture.collect().tables()
        capture.close()
        for layer, table in enumerate(tables):
            assert torch.isfinite(table).all()
            for col, head in enumerate([None, 0, 1, 2, 3]):
                assert got["max_logit"][step][(layer, head)] == pytest.approx(float(table[0, col]), rel=TOL, abs=TOL)
                assert got["entropy"][step][(layer, head)] == pytest.approx(float(table[1, col]), rel=TOL, abs=TOL)
