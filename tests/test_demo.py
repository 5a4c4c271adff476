"""The demo in tiny mode: real Trainer, real files; the objectives checked against the model's own outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attn_probe import demo  # noqa: E402
from attn_probe.cli import main  # noqa: E402

TINY = [
    "--size",
    "tiny",
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--seq-len",
    "16",
    "--every",
    "2",
    "--vocab-size",
    "200",
    "--max-chars",
    "20000",
    "--no-progress",
]


def _trajectory(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def small_data():
    texts = demo.load_texts(max_chars=20_000)
    tok = demo.train_tokenizer(texts, vocab_size=200)
    return tok, demo.make_blocks(texts, tok, 16)


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
def test_demo_cli_writes_events_trajectory_figure_and_table(tmp_path, capsys, arch):
    rc = main(["demo", *TINY, "--arch", arch, "--out-dir", str(tmp_path), "--name", "t"])
    assert rc == 0
    out = capsys.readouterr().out
    root = tmp_path / "t"
    assert f"tensorboard --logdir {root}" in out
    figure = root / "dynamics.png"
    assert f"figure: {figure}" in out
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for kind in ("encoder", "decoder"):
        run = root / kind
        assert list(run.glob("events.out.tfevents.*")), f"no TensorBoard events in {run}"
        rows = _trajectory(run / "attn_probe.jsonl")
        layer_rows = [r for r in rows if r["head"] is None]
        assert {r["step"] for r in layer_rows} == {0, 2, 4, 6}
        assert {r["layer"] for r in layer_rows} == {0, 1}  # tiny = 2 layers
        assert {r["metric"] for r in layer_rows} >= {"symmetry", "directionality"}
        assert {r["group"] for r in layer_rows} == {"self"}
        assert kind in out
    # the table's medians are those of the last snapshot in the trajectory file
    table = out[out.index("symmetry median") :]
    for kind in ("encoder", "decoder"):
        rows = [
            r
            for r in _trajectory(root / kind / "attn_probe.jsonl")
            if r["head"] is None and r["step"] == 6 and r["metric"] == "symmetry"
        ]
        median = sorted(r["value"] for r in rows)
        expected = (median[0] + median[1]) / 2
        line = next(ln for ln in table.splitlines() if ln.startswith(kind))
        assert f"{expected:+.3f}" in line


def test_symmetric_init_flag_starts_at_symmetry_one(tmp_path):
    rc = main(
        [
            "demo",
            *TINY,
            "--steps",
            "2",
            "--models",
            "encoder",
            "--symmetric-init",
            "--no-figure",
            "--out-dir",
            str(tmp_path),
            "--name",
            "s",
        ]
    )
    assert rc == 0
    rows = _trajectory(tmp_path / "s" / "encoder" / "attn_probe.jsonl")
    start = [r["value"] for r in rows if r["step"] == 0 and r["metric"] == "symmetry" and r["head"] is None]
    assert len(start) == 2 and all(v == pytest.approx(1.0, abs=1e-4) for v in start)
    assert not (tmp_path / "s" / "decoder").exists()


def test_user_errors_are_one_line(tmp_path, capsys):
    assert main(["demo", "--text", str(tmp_path / "missing.txt"), "--out-dir", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["demo", *TINY, "--steps", "0", "--out-dir", str(tmp_path)]) == 2
    assert "steps must be a positive integer" in capsys.readouterr().err


def test_dataset_without_datasets_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(demo.DemoError, match="pip install datasets"):
        demo.load_texts(dataset="wikitext")


def test_user_text_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("The quick brown fox jumps over the lazy dog.\n" * 50)
    texts = demo.load_texts([str(f)])
    tok = demo.train_tokenizer(texts, vocab_size=100)
    blocks = demo.make_blocks(texts, tok, 8)
    assert blocks.shape[1] == 8 and blocks.shape[0] >= 10
    # real words become tokens: characters are not spaced out (the paper code's " ".join bug)
    assert tok.tokenize("quick brown fox") == ["quick", "brown", "fox"]
    assert tok.decode(blocks[0]).startswith("The quick brown fox")


def test_shakespeare_corpus_is_plain_text():
    texts = demo.shakespeare_texts()
    assert len(texts) >= 30
    joined = "\n".join(texts)
    assert "To be, or not to be" in joined
    assert "**" not in joined and "\n#" not in joined


def test_blocks_are_the_token_stream(small_data):
    tok, blocks = small_data
    texts = demo.load_texts(max_chars=20_000)
    stream = []
    for t in texts:
        stream += tok(t, add_special_tokens=False)["input_ids"] + [tok.sep_token_id]
    flat = blocks.flatten().tolist()
    assert flat == stream[: len(flat)] and len(stream) - len(flat) < 16


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
def test_decoder_is_causal_and_encoder_is_bidirectional(arch):
    """Changing a later token must not change earlier logits of the decoder, but does for the encoder."""
    ids = torch.randint(5, 200, (1, 12))
    later = ids.clone()
    later[0, 8:] = torch.randint(5, 200, (4,))
    for kind, causal in (("decoder", True), ("encoder", False)):
        model = demo.build_model(kind, "tiny", 200, 16, arch=arch).eval()
        with torch.no_grad():
            a, b = model(input_ids=ids).logits, model(input_ids=later).logits
        assert torch.allclose(a[0, :8], b[0, :8], atol=1e-5) is causal, kind


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
def test_decoder_objective_is_next_token_loss_on_every_position(small_data, arch):
    tok, blocks = small_data
    batch = demo.make_collator("decoder", tok)([{"input_ids": b} for b in blocks[:4]])
    assert torch.equal(batch["input_ids"], blocks[:4])  # no corruption of the inputs
    assert torch.equal(batch["labels"], blocks[:4])  # every position is a target
    model = demo.build_model("decoder", "tiny", len(tok), 16, pad_token_id=tok.pad_token_id, arch=arch)
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
    manual = torch.nn.functional.cross_entropy(logits, batch["input_ids"][:, 1:].reshape(-1))
    assert out.loss.item() == pytest.approx(manual.item(), rel=1e-5)


def test_encoder_objective_masks_about_15_percent(small_data):
    tok, blocks = small_data
    torch.manual_seed(0)
    batch = demo.make_collator("encoder", tok)([{"input_ids": b} for b in blocks[:64]])
    targets = batch["labels"] != -100
    assert 0.10 < targets.float().mean().item() < 0.20
    assert torch.equal(batch["labels"][targets], blocks[:64][targets])
    assert (batch["input_ids"][targets] == tok.mask_token_id).float().mean().item() > 0.6


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
def test_same_initial_attention_weights_for_both_models(arch):
    enc = demo.build_model("encoder", "tiny", 200, 16, seed=3, arch=arch)
    dec = demo.build_model("decoder", "tiny", 200, 16, seed=3, arch=arch)
    layers = list(zip(enc.base_model.encoder.layer, dec.base_model.encoder.layer, strict=True))
    assert len(layers) == demo.SIZES["tiny"][0]
    for le, ld in layers:
        assert torch.equal(le.attention.self.query.weight, ld.attention.self.query.weight)
        assert torch.equal(le.attention.self.key.weight, ld.attention.self.key.weight)


@pytest.mark.parametrize(("arch", "post_ln"), [("bert", True), ("bert-preln", False)])
def test_layer_norm_placement(arch, post_ln):
    """Post-LN layers end in a LayerNorm (each position's output has mean 0 and variance 1 at init,
    where the LayerNorm is the identity affine map); pre-LN layers end in the raw residual sum."""
    model = demo.build_model("encoder", "tiny", 200, 16, arch=arch).eval()
    with torch.no_grad():
        hidden = model.base_model(input_ids=torch.randint(5, 200, (2, 12)), output_hidden_states=True).hidden_states
    for h in hidden[1:-1]:  # layer outputs (pre-LN models apply a final LayerNorm after the last)
        normalised = torch.allclose(h.mean(-1), torch.zeros(()), atol=1e-4) and torch.allclose(
            h.var(-1, unbiased=False), torch.ones(()), atol=1e-2
        )
        assert normalised is post_ln


def test_figure_failure_keeps_the_table_and_exits_1(tmp_path, capsys, monkeypatch):
    import attn_probe

    def broken(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr(attn_probe, "plot_dynamics", broken, raising=False)
    rc = main(
        ["demo", *TINY, "--steps", "1", "--models", "encoder", "--out-dir", str(tmp_path), "--name", "f"]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "symmetry median" in out and "could not draw the figure (RuntimeError: no display)" in out
    assert (tmp_path / "f" / "encoder" / "attn_probe.jsonl").is_file()


def _expected_unigram_bias(blocks: torch.Tensor, vocab: int) -> np.ndarray:
    counts = np.bincount(blocks.numpy().ravel(), minlength=vocab)[:vocab].astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return logp - logp.mean()


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_unigram_bias_enters_the_logits_as_log_frequencies(small_data, kind, arch):
    tok, blocks = small_data
    vocab = len(tok)
    model = demo.build_model(kind, "tiny", vocab, 16, pad_token_id=tok.pad_token_id, arch=arch).eval()
    x = blocks[:3]
    with torch.no_grad():
        before = model(input_ids=x).logits
        demo.init_output_bias_to_unigram_(model, blocks)
        after = model(input_ids=x).logits
    shift = (after - before).double().numpy()
    np.testing.assert_allclose(shift, np.broadcast_to(_expected_unigram_bias(blocks, vocab), shift.shape), atol=1e-5)


def test_unigram_bias_starts_the_decoder_near_the_unigram_entropy(small_data):
    tok, blocks = small_data
    vocab = len(tok)
    counts = np.bincount(blocks.numpy().ravel(), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())
    model = demo.build_model("decoder", "tiny", vocab, 16, pad_token_id=tok.pad_token_id).eval()
    x = blocks[:64]
    with torch.no_grad():
        zero_bias_loss = float(model(input_ids=x, labels=x).loss)
        demo.init_output_bias_to_unigram_(model, blocks)
        unigram_loss = float(model(input_ids=x, labels=x).loss)
    assert zero_bias_loss == pytest.approx(np.log(vocab), abs=0.2)
    assert abs(unigram_loss - unigram_entropy) < 0.3 < zero_bias_loss - unigram_loss


@pytest.mark.parametrize("unigram_bias", [True, False])
def test_train_model_applies_the_unigram_bias_unless_disabled(small_data, tmp_path, unigram_bias):
    tok, blocks = small_data
    cfg = demo.DemoConfig(size="tiny", steps=1, batch_size=2, seq_len=16, progress=False,
                          unigram_bias=unigram_bias)
    seen = {}
    demo.train_model("encoder", tok, blocks, cfg, tmp_path, probe=False,
                     model_hook=lambda m: seen.setdefault("bias", m.get_output_embeddings().bias.detach().clone()))
    expected = _expected_unigram_bias(blocks, len(tok)) if unigram_bias else np.zeros(len(tok))
    np.testing.assert_allclose(seen["bias"].double().numpy(), expected, atol=1e-5)


def test_unigram_bias_needs_an_output_bias(small_data):
    from transformers import GPT2Config, GPT2LMHeadModel

    _, blocks = small_data
    model = GPT2LMHeadModel(GPT2Config(vocab_size=200, n_embd=16, n_layer=1, n_head=2))  # lm_head has no bias
    with pytest.raises(demo.DemoError, match="no output-layer bias"):
        demo.init_output_bias_to_unigram_(model, blocks)
