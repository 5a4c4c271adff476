"""The demo in tiny mode: real Trainer, real files; the objectives checked against the model's own outputs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
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
    "--sequential",  # in this process; tests/demo/test_demo_processes.py trains the models at the same time
]


def _trajectory(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip() and '"run_header"' not in line]


@pytest.fixture(scope="module")
def small_data():
    texts = demo.load_texts(max_chars=20_000)
    tok = demo.train_tokenizer(texts, vocab_size=200)
    return tok, demo.make_blocks(texts, tok, 16)


# --------------------------------------------------------------------------- character tokens
def test_char_tokenizer_is_one_token_per_character_and_round_trips():
    texts = demo.load_texts(max_chars=20_000)
    counts: dict[str, int] = {}
    for t in texts:
        for c in t:
            counts[c] = counts.get(c, 0) + 1
    frequent = sorted(c for c, n in counts.items() if n >= 20)
    tok = demo.make_tokenizer(texts, "chars")
    # vocabulary: the special tokens, then the characters seen >= 20 times, sorted
    expected_vocab = {t: i for i, t in enumerate([*demo.SPECIAL_TOKENS, *frequent])}
    assert tok.get_vocab() == expected_vocab and "\n" in expected_vocab and " " in expected_vocab
    line = "Enter ROMEO.\nBut, soft!  what light"
    assert set(line) <= set(frequent)
    ids = tok(line, add_special_tokens=False)["input_ids"]
    assert ids == [expected_vocab[c] for c in line]
    assert "".join(tok.convert_ids_to_tokens(ids)) == line
    rare = next(c for c, n in counts.items() if n < 20)
    assert tok(rare, add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    # without whitespace: the released code's character stream
    nospace = demo.make_tokenizer(texts, "chars-nospace")
    assert not any(c.isspace() for c in nospace.get_vocab())
    got = nospace.convert_ids_to_tokens(nospace(line, add_special_tokens=False)["input_ids"])
    assert got == [c for c in line if not c.isspace()]
    # the blocks are the documents' character stream, [SEP] between documents
    blocks = demo.make_blocks(texts[:1], tok, 16)
    first = [expected_vocab.get(c, tok.unk_token_id) for c in texts[0][:16]]
    assert blocks[0].tolist() == first
    with pytest.raises(demo.DemoError, match="unknown tokens"):
        demo.make_tokenizer(texts, "bytes")


def _explicit_layer_symmetry(model) -> list[float]:
    """<M, M^T>_F / ||M||_F^2 of M = Q^T K (heads stacked along the rows of query/key.weight), float64."""
    out = []
    for name, mod in model.named_modules():
        if name.endswith("attention.self"):
            q, k = mod.query.weight.detach().double(), mod.key.weight.detach().double()
            m = q.T @ k
            out.append(float((m * m.T).sum() / (m * m).sum()))
    return out


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
def test_demo_cli_writes_events_trajectory_figure_and_table(tmp_path, capsys, arch):
    """A tiny run with the cpu preset's character tokens: files, table, the saved tokenizer round-trips
    text, and the last trajectory snapshot is the symmetry of the saved model's own W_q/W_k."""
    import transformers

    rc = main(["demo", *TINY, "--arch", arch, "--out-dir", str(tmp_path), "--name", "t"])
    assert rc == 0
    out = capsys.readouterr().out
    root = tmp_path / "t"
    texts = demo.load_texts(max_chars=20_000)
    assert f"vocabulary {len(demo.make_tokenizer(texts, 'chars'))};" in out
    classes = demo.ARCHITECTURES[arch]
    for kind, cls in (("encoder", classes.masked_lm), ("decoder", classes.causal_lm)):
        model_dir = root / kind / "model"
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        sample = texts[0][:200]
        ids = tok(sample, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(sample)  # one token per character, whitespace included
        vocab = tok.get_vocab()
        assert tok.convert_ids_to_tokens(ids) == [c if c in vocab else "[UNK]" for c in sample]
        model = getattr(transformers, cls).from_pretrained(str(model_dir))
        assert model.config.vocab_size == len(tok)
        rows = [r for r in _trajectory(root / kind / "attn_probe.jsonl")
                if r["head"] is None and r["step"] == 6 and r["metric"] == "symmetry"]
        got = [r["value"] for r in sorted(rows, key=lambda r: r["layer"])]
        assert got == pytest.approx(_explicit_layer_symmetry(model), abs=1e-5)
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
    # the command it prints to draw the figure later runs as printed, and draws it (the paper's run too)
    monkeypatch.undo()
    command = next(ln for ln in out.splitlines() if "draw it later with: " in ln).split("draw it later with: ", 1)[1]
    assert "--reference 4-layer-encoder-" in command
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, (command, done.stderr)
    assert (tmp_path / "f" / "dynamics.png").stat().st_size > 0


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


# --------------------------------------------------------------------------- objectives, by hand
def _explicit_loss(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> float:
    """Mean over labelled targets of -log softmax(logits at the predicting position)[label], in float64,
    one position at a time: position t predicts labels[t + 1] when ``shift``, else labels[t]."""
    logp = torch.log_softmax(logits.detach().double(), dim=-1)
    total, n = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - (1 if shift else 0)):
            target = int(labels[b, t + 1] if shift else labels[b, t])
            if target == -100:
                continue
            total -= float(logp[b, t, target])
            n += 1
    return total / n


def _scramble(model):
    """Random weights far from the initialisation, so that the logits differ a lot between positions
    and a wrong shift or a wrong target set changes the loss by far more than the tolerance."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
def test_paper_mlm_decoder_objective_is_the_mlm_batch_shifted_by_the_causal_lm(small_data, arch):
    tok, blocks = small_data
    torch.manual_seed(1)
    batch = demo.make_collator("decoder", tok, "paper-mlm")([{"input_ids": b} for b in blocks[:8]])
    targets = batch["labels"] != -100
    # the masked-LM collator's batch, unchanged: labels only at the masked positions, corrupted inputs
    assert 0 < targets.float().mean().item() < 0.3
    assert torch.equal(batch["labels"][targets], blocks[:8][targets])
    assert torch.equal(batch["input_ids"][~targets], blocks[:8][~targets])
    assert (batch["input_ids"][targets] == tok.mask_token_id).any()
    model = _scramble(demo.build_model("decoder", "tiny", len(tok), 16, pad_token_id=tok.pad_token_id, arch=arch))
    out = model(**batch)
    shifted = _explicit_loss(out.logits, batch["labels"], shift=True)
    unshifted = _explicit_loss(out.logits, batch["labels"], shift=False)
    assert out.loss.item() == pytest.approx(shifted, rel=1e-5)
    assert abs(unshifted - shifted) > 0.02  # far beyond the tolerance: the comparison tells the two apart


@pytest.mark.parametrize("arch", list(demo.ARCHITECTURES))
def test_causal_decoder_and_encoder_losses_against_the_explicit_computation(small_data, arch):
    tok, blocks = small_data
    torch.manual_seed(2)
    causal = demo.make_collator("decoder", tok, "causal")([{"input_ids": b} for b in blocks[:4]])
    assert torch.equal(causal["labels"], blocks[:4])
    model = _scramble(demo.build_model("decoder", "tiny", len(tok), 16, pad_token_id=tok.pad_token_id, arch=arch))
    out = model(**causal)
    assert out.loss.item() == pytest.approx(_explicit_loss(out.logits, causal["labels"], shift=True), rel=1e-5)
    assert abs(out.loss.item() - _explicit_loss(out.logits, causal["labels"], shift=False)) > 0.02

    masked = demo.make_collator("encoder", tok)([{"input_ids": b} for b in blocks[:8]])
    encoder = _scramble(demo.build_model("encoder", "tiny", len(tok), 16, pad_token_id=tok.pad_token_id, arch=arch))
    out = encoder(**masked)  # the masked LM predicts each label at its own position
    assert out.loss.item() == pytest.approx(_explicit_loss(out.logits, masked["labels"], shift=False), rel=1e-5)
    assert abs(out.loss.item() - _explicit_loss(out.logits, masked["labels"], shift=True)) > 0.02


def test_decoder_objective_reaches_the_trainer(small_data, tmp_path):
    tok, blocks = small_data
    seen = []

    def spy(kind, tokenizer, objective="causal"):
        seen.append((kind, objective))
        return real(kind, tokenizer, objective)

    from attn_probe.demo import training

    real = training.make_collator  # the name train_model calls (imported from .data)
    cfg = demo.DemoConfig(size="tiny", steps=1, batch_size=2, seq_len=16, progress=False,
                          decoder_objective="paper-mlm")
    try:
        training.make_collator = spy
        demo.train_model("decoder", tok, blocks, cfg, tmp_path, probe=False)
    finally:
        training.make_collator = real
    assert seen == [("decoder", "paper-mlm")]
    with pytest.raises(demo.DemoError, match="decoder objective"):
        demo.make_collator("decoder", tok, "mlm")


# --------------------------------------------------------------------------- presets
def _parse(argv):
    from attn_probe.cli import build_parser

    return demo.config_from_args(build_parser().parse_args(["demo", *argv]))


def test_cpu_preset_is_the_dataclass_default():
    d = demo.DemoConfig()
    for name, value in demo.resolve_preset("cpu").items():
        assert getattr(d, name) == value, name
    assert d.preset == "cpu" and d.decoder_objective == "causal"


def test_preset_fills_unset_flags_and_given_flags_win(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _parse(["--preset", "paper-small", "--steps", "300", "--batch-size", "8"])
    # --batch-size 8 equals the cpu preset's value: it still overrides paper-small's 32
    assert (cfg.preset, cfg.steps, cfg.batch_size) == ("paper-small", 300, 8)
    assert (cfg.lr, cfg.warmup, cfg.seq_len, cfg.size, cfg.save_every) == (5e-4, 200, 128, "mini", 2000)
    assert cfg.arch == "bert"  # the paper's post-LN BERT, as measured at 12,000 steps
    assert cfg.precision == "fp32"  # no CUDA: no bf16
    assert "--steps 300" in cfg.preset_reason and "--batch-size 8" in cfg.preset_reason
    assert "many hours on a CPU" in cfg.preset_reason
    assert cfg.tokens == "wordpiece"  # the paper-small preset stays word level
    cpu = _parse(["--lr", "1e-3"])
    assert cpu.preset == "cpu" and "no CUDA" in cpu.preset_reason
    # the sweep's ch128-s32-b32-lr2e-3 (docs/reproducing-the-paper.md), with the given lr
    assert (cpu.steps, cpu.batch_size, cpu.seq_len, cpu.warmup, cpu.lr, cpu.arch, cpu.size, cpu.tokens) == (
        1500, 32, 32, 100, 1e-3, "bert-preln", "mini-128", "chars")
    assert demo.SIZES[cpu.size] == (4, 128, 4, 512)
    assert _parse(["--preset", "paper-small", "--tokens", "chars"]).tokens == "chars"
    assert _parse(["--preset", "paper-small", "--arch", "bert-preln"]).arch == "bert-preln"
    assert _parse(["--preset", "cpu", "--precision", "bf16"]).precision == "bf16"


def test_paper_small_is_the_default_with_cuda_and_uses_bf16_where_supported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    for supported, precision in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported: s)
        cfg = _parse([])
        assert (cfg.preset, cfg.arch, cfg.steps, cfg.batch_size, cfg.precision) == (
            "paper-small", "bert", 12_000, 32, precision)
        assert "CUDA is available (Fake GPU)" in cfg.preset_reason
    assert _parse(["--preset", "cpu"]).steps == 1500


def test_preset_errors_are_one_line(tmp_path, capsys):
    assert main(["demo", *TINY, "--resume", "--out-dir", str(tmp_path)]) == 2
    assert "--resume needs checkpoints" in capsys.readouterr().err
    with pytest.raises(demo.DemoError, match="unknown preset"):
        demo.resolve_preset("gpu")


# --------------------------------------------------------------------------- interpretation
def test_unigram_entropy_against_numpy(small_data):
    _, blocks = small_data
    counts = np.bincount(blocks.numpy().ravel()).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    assert demo.unigram_entropy(blocks) == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([(10, 6.5), (20, 6.2), (30, 5.4), (40, 6.1), (50, 5.3)], 30),  # <= 6.6 - 0.5 = 6.1 from step 30
        ([(10, 5.0), (20, 5.0), (30, 6.2), (40, 5.0), (50, 5.0)], None),  # two, a break, two
        ([(10, 5.0), (20, 5.0), (30, 6.2), (40, 5.0), (50, 5.0), (60, 6.1)], 40),  # 6.1 is exactly 0.5 below
        ([(10, 6.11), (20, 6.11), (30, 6.11)], None),  # 0.49 below is not enough
        ([], None),
    ],
)
def test_plateau_exit(losses, expected):
    assert demo.plateau_exit(losses, 6.6) == expected


def _fake_model(kind, symmetry, final_loss=6.0):
    rows = [{"head": None, "layer": i, "symmetry": s, "directionality": -0.1} for i, s in enumerate(symmetry)]
    return demo.ModelResult(kind, Path("."), final_loss, [(10, final_loss)], rows, 1.0)


def test_interpret_names_the_gap_the_phase_and_the_gpu_preset():
    models = {"encoder": _fake_model("encoder", [0.1, 0.3, 0.2]), "decoder": _fake_model("decoder", [0.0, 0.05])}
    before = demo.DemoResult(Path("."), models, None, demo.DemoConfig(), unigram_entropy=6.6,
                             plateau_exits={"encoder": None, "decoder": 120})
    assert before.gap == pytest.approx(0.2 - 0.025)
    text = "\n".join(demo.interpret(before, cuda=False))
    assert "encoder - decoder median layer symmetry: +0.175" in text
    assert "encoder: still on the unigram plateau" in text and "<= 6.10" in text
    assert "decoder: left the unigram plateau at step 120" in text
    assert "phase: before the takeoff" in text and "left at step 540-570" in text
    assert "attn-probe demo --preset paper-small on a GPU" in text and demo.GPU_SECTION in text
    on_gpu = "\n".join(demo.interpret(before, cuda=True))
    assert "--preset paper-small (" in on_gpu and "on a GPU" not in on_gpu
    after = dataclasses.replace(before, plateau_exits={"encoder": 540, "decoder": 120})
    text = "\n".join(demo.interpret(after, cuda=False))
    assert "phase: takeoff" in text and "encoder: left the unigram plateau at step 540" in text
    assert "before the takeoff" not in text and "--preset paper-small" not in text
    only = demo.DemoResult(Path("."), {"decoder": models["decoder"]}, None, demo.DemoConfig())
    assert only.gap is None and "symmetry:" not in "\n".join(demo.interpret(only, cuda=False))


def test_docs_have_the_section_the_demo_points_to():
    docs = (Path(__file__).resolve().parents[2] / demo.DOCS).read_text()
    anchor = demo.GPU_SECTION.split("#", 1)[1]
    headings = ["-".join(re.sub(r"[^\w\s-]", "", h.lower()).split()) for h in re.findall(r"^#+ (.+)$", docs, re.M)]
    assert anchor in headings


def test_demo_prints_its_own_interpretation(tmp_path, capsys, monkeypatch):
    """The printed gap and phase are those of the run's own trajectory files and TensorBoard loss."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = demo.config_from_args(_namespace(TINY + ["--steps", "4", "--no-figure", "--decoder-objective",
                                                   "paper-mlm", "--out-dir", str(tmp_path), "--name", "i"]))
    result = demo.run_demo(cfg)
    out = capsys.readouterr().out
    assert "preset: cpu (no CUDA device" in out and "decoder objective paper-mlm" in out
    medians = {}
    for kind in ("encoder", "decoder"):
        rows = [r for r in _trajectory(tmp_path / "i" / kind / "attn_probe.jsonl")
                if r["head"] is None and r["step"] == 4 and r["metric"] == "symmetry"]
        medians[kind] = float(np.median([r["value"] for r in rows]))
        # the losses the phase is judged on are the ones in the run's TensorBoard events
        logged, events = result.models[kind].losses, _tb_scalars(tmp_path / "i" / kind, "train/loss")
        assert [s for s, _ in logged] == [s for s, _ in events] and logged
        assert [v for _, v in logged] == pytest.approx([v for _, v in events], rel=1e-6)
        assert result.plateau_exits[kind] == demo.plateau_exit(result.models[kind].losses, result.unigram_entropy)
    assert f"encoder - decoder median layer symmetry: {medians['encoder'] - medians['decoder']:+.3f}" in out
    assert f"unigram entropy {demo.unigram_entropy(demo.prepare_data(cfg)[1]):.2f} nats" in out
    # 4 steps: the encoder cannot have left the plateau
    assert result.plateau_exits["encoder"] is None
    assert "phase: before the takeoff" in out and "attn-probe demo --preset paper-small on a GPU" in out


def _namespace(argv):
    from attn_probe.cli import build_parser

    return build_parser().parse_args(["demo", *argv])


def _tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_resume_continues_from_the_last_checkpoint(tmp_path, capsys):
    args = [*TINY, "--models", "encoder", "--no-figure", "--save-every", "3", "--threads", "1",
            "--out-dir", str(tmp_path), "--name", "r"]
    assert main(["demo", *args]) == 0
    trainer_dir = tmp_path / "r" / "encoder" / "trainer"
    assert sorted(p.name for p in trainer_dir.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-3", "checkpoint-6"]
    first = _tb_scalars(tmp_path / "r" / "encoder", "train/loss")
    import shutil

    shutil.rmtree(trainer_dir / "checkpoint-6")  # as if the first command had stopped after step 3
    capsys.readouterr()
    assert main(["demo", *args, "--resume"]) == 0
    assert "(resumed from checkpoint-3)" in capsys.readouterr().out
    rows = [r for r in _trajectory(tmp_path / "r" / "encoder" / "attn_probe.jsonl") if r["head"] is None]
    keys = [(r["step"], r["layer"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))  # no step written twice
    assert {r["step"] for r in rows} == {0, 2, 3, 4, 6}  # 3: the resume snapshot
    second = _tb_scalars(tmp_path / "r" / "encoder", "train/loss")
    assert [s for s, _ in second] == [2, 4, 6]  # the earlier run's step 4 and 6 were purged
    assert second[0] == pytest.approx(first[0])  # before the checkpoint: the first command's loss


# --------------------------------------------------------------------------- the symmetric-init benchmark
def _bench():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_symmetric_init.py"
    spec = importlib.util.spec_from_file_location("bench_symmetric_init", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fraction_saved_uses_the_smoothed_curves():
    bench = _bench()
    standard = [(0, 7.0), (100, 6.0), (200, 5.0), (300, 5.2), (400, 4.8)]
    assert bench.smooth(standard, 2) == [(0, 7.0), (100, 6.5), (200, 5.5), (300, 5.1), (400, 5.0)]
    # target: the standard run's final smoothed loss, (5.2 + 4.8) / 2 = 5.0
    symmetric = [(0, 7.0), (100, 4.7), (200, 5.6), (300, 4.9), (400, 4.9)]
    # unsmoothed, one noisy dip at step 100 would count as reaching the standard run's final 4.8
    assert bench.fraction_saved(standard, symmetric, 400, 1) == pytest.approx((4.8, 100, 0.75))
    # smoothed over 2: target (5.2 + 4.8) / 2 = 5.0; the symmetric run reads 7.0, 5.85, 5.15, 5.25, 4.9
    assert bench.fraction_saved(standard, symmetric, 400, 2) == pytest.approx((5.0, 400, 0.0))
    assert bench.fraction_saved(standard, [(0, 7.0), (400, 5.5)], 400, 2)[1:] == (None, None)


def test_benchmark_runs_tiny_and_resumes(tmp_path, capsys):
    bench = _bench()
    argv = ["--size", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--vocab-size", "200",
            "--max-chars", "20000", "--eval-every", "2", "--eval-blocks", "4", "--smooth", "2", "--threads", "1",
            "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "out.json"), "--resume"]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    base = result["variants"]["base"]
    sym = base["runs"]["symmetric"]
    assert [s for s, _ in sym["eval_curve"]] == [0, 2, 4]
    assert sym["symmetry_curve"][0][1] == pytest.approx(1.0, abs=1e-4)
    std = base["runs"]["standard"]
    target, reached, saved = bench.fraction_saved(std["eval_curve"], sym["eval_curve"], 4, 2)
    assert (base["baseline_final_smoothed_loss"], base["symmetric_steps_to_baseline_final"],
            base["fraction_of_training_saved"]) == (target, reached, saved)
    capsys.readouterr()
    assert bench.main(argv) == 0  # the same command again: both runs are reused, nothing retrains
    assert capsys.readouterr().out.count("finished earlier") == 2
