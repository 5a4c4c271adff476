"""torchtitan 0.3's fused and unfused QKV, torchtune's LoRA, DoRA and QLoRA (issue 38, item 1).

Every layer's weights must equal, in float64, those the module's *own* forward computes with: the
projection module is run on the identity (``x = I_d``, one token per basis vector, no bias), its q and k
are taken after its own head split (torchtitan's ``qkv_linear(x)`` returns them per head; torchtune's
``q_proj``/``k_proj`` outputs are viewed as ``MultiHeadAttention.forward`` views them), and
``M = sum_h q_h k_{h // (H / Hkv)}^T``. attn_probe's ``qk_matrix`` must equal ``M`` and its symmetry and
directionality must equal those of ``M`` computed here.

The verbatim-shaped modules of ``tests/third_party_layouts.py`` run everywhere (CI); the real packages
(torchtitan 0.3.0, torchtune 0.6.1 with torchao for QLoRA) are tested where they import: they cannot join
the test extra (torchtitan pins ``spmd_types`` and needs ``triton``; torchtune needs ``torchao``, whose
NF4 tensor moved after 0.11), so they are installed apart:
``pip install --target DIR --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro triton torchtune==0.6.1
torchao==0.11.0 omegaconf antlr4-python3-runtime==4.9.3 sentencepiece tiktoken blobfile kagglehub
typeguard docstring_parser shtab`` and ``PYTHONPATH=DIR``.
"""

from __future__ import annotations

import pytest
import torch
from third_party_layouts import DoRALinear, FusedQKVLinear, LoRALinear, QKVLinear, TitanModel, TuneModel
from torch import nn

from attn_probe import score_model
from attn_probe.extraction import find_attention
from tests.extraction.test_research_layouts import directionality64, symmetry64  # the explicit float64 scores


def own_matrix(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q (d, H, dh)``, ``k (d, Hkv, dh)``: row ``i`` is the token ``e_i``'s query/key per head."""
    q, k = q.detach().double(), k.detach().double()
    group = q.shape[1] // k.shape[1]
    return sum(q[:, h] @ k[:, h // group].T for h in range(q.shape[1]))


def titan_own(attn: nn.Module) -> torch.Tensor:
    d = attn.qkv_linear.wqkv.in_features if hasattr(attn.qkv_linear, "wqkv") else attn.qkv_linear.wq.in_features
    with torch.no_grad():
        q, k, _ = attn.qkv_linear(torch.eye(d, dtype=torch.float64).unsqueeze(0))
    return own_matrix(q[0], k[0])


def tune_own(attn: nn.Module) -> torch.Tensor:
    d, dh = attn.embed_dim, attn.head_dim
    eye = torch.eye(d, dtype=torch.float64)
    with torch.no_grad():
        q = attn.q_proj(eye).view(d, attn.num_heads, dh)  # as MultiHeadAttention.forward views it
        k = attn.k_proj(eye).view(d, -1, dh)
    return own_matrix(q, k)


def assert_equal_own(model: nn.Module, attns: list[nn.Module], own, layers=None, tol: float = 1e-9,
                     score_tol: float = 1e-9) -> None:
    layers = layers if layers is not None else find_attention(model)
    assert [a.module for a in layers] == attns
    rows = [r for r in score_model(model, metrics=("symmetry", "directionality"), dtype=torch.float64)
            if r["head"] is None]
    for layer, attn, row in zip(layers, attns, rows, strict=True):
        m = own(attn)
        assert torch.allclose(layer.qk_matrix().double(), m, atol=tol * float(m.abs().max())), layer.name
        assert row["symmetry"] == pytest.approx(symmetry64(m), abs=score_tol), layer.name
        assert row["directionality"] == pytest.approx(directionality64(m), abs=score_tol), layer.name


def perturb(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter random (LoRA's B starts at zero, DoRA's magnitude equal to the norms: both
    would hide a missing term), in float64."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model.double().eval()


# --------------------------------------------------------------------------- torchtitan (verbatim-shaped)
@pytest.mark.parametrize(("heads", "kv", "fuse"), [(8, 2, True), (4, 4, True), (4, 1, True), (8, 2, False)])
def test_torchtitan_qkv_linear_equals_its_own_forward(heads: int, kv: int, fuse: bool) -> None:
    model = perturb(TitanModel(dim=32, n_heads=heads, n_kv_heads=kv, fuse_qkv=fuse), seed=heads + kv)
    layers = find_attention(model)
    assert [(a.name, a.num_heads, a.num_kv_heads, a.head_dim) for a in layers] == [
        (f"layers.{i}.attention", heads, kv, 32 // heads) for i in range(2)]
    assert_equal_own(model, [b.attention for b in model.layers], titan_own, layers)


def test_torchtitan_fused_query_rows_are_read_per_kv_group() -> None:
    """Only the query rows of KV group 1 set: the query heads of group 1 (heads 4..7) carry the layer,
    paired with key head 1; read as [q | k | v] blocks instead, they would land on other heads."""
    model = perturb(TitanModel(dim=32, n_heads=8, n_kv_heads=2, n_layers=1), seed=5)
    fused = model.layers[0].attention.qkv_linear
    with torch.no_grad():
        rows = fused.wqkv.weight.view(2, fused.r_dim, 4, 32)
        rows[0, :4] = 0.0  # group 0's queries
    rows_by_head = [r for r in score_model(model, per_head=True, metrics=("spectral_norm",)) if r["head"] is not None]
    assert [r["head"] for r in rows_by_head if r["spectral_norm"] > 1e-9] == [4, 5, 6, 7]


# --------------------------------------------------------------------------- torchtune (verbatim-shaped)
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_torchtune_adapters_equal_their_own_forward_in_every_state(dora: bool) -> None:
    model = perturb(TuneModel(dora=dora, embed_dim=32, num_heads=4, num_kv_heads=2), seed=11 + dora)
    attns = [layer["attn"] for layer in model.layers]
    layers = find_attention(model)
    assert [(a.name, a.num_heads, a.num_kv_heads) for a in layers] == [(f"layers.{i}.attn", 4, 2) for i in range(2)]
    names = set(layers[0].param_names)
    assert {"layers.0.attn.q_proj.lora_a.weight", "layers.0.attn.k_proj.lora_b.weight"} <= names
    assert ("layers.0.attn.q_proj.magnitude" in names) == dora
    assert_equal_own(model, attns, tune_own, layers)
    base = [own_matrix(a.q_proj.weight.T.reshape(32, 4, 8), a.k_proj.weight.T.reshape(32, 2, 8)) for a in attns]
    assert not torch.allclose(base[0], tune_own(attns[0]), atol=1e-3)  # the adapters change the weights
    for a in attns:  # the state is read when the weights are, not when the layers were found
        a.q_proj.disabled = a.k_proj.disabled = True
    assert torch.allclose(tune_own(attns[0]), base[0])
    assert_equal_own(model, attns, tune_own, layers)
    attns[1].q_proj.disabled = False  # one projection of one layer back on
    assert_equal_own(model, attns, tune_own, layers)


def test_torchtune_dora_magnitude_is_not_the_lora_weight() -> None:
    """DoRA's rows are rescaled: read as plain LoRA (W + s B A) the scores would differ."""
    model = perturb(TuneModel(dora=True, n_layers=1), seed=3)
    attn = model.layers[0]["attn"]
    q, k = attn.q_proj, attn.k_proj
    lora_w = [p.weight + p.scaling * p.lora_b.weight @ p.lora_a.weight for p in (q, k)]
    plain = own_matrix(lora_w[0].T.reshape(32, 4, 8), lora_w[1].T.reshape(32, 2, 8))
    assert abs(symmetry64(plain) - symmetry64(tune_own(attn))) > 1e-3
    assert score_model(model)[0]["symmetry"] == pytest.approx(symmetry64(tune_own(attn)), abs=1e-6)


def test_torchtune_qat_fake_quantized_weight_is_refused() -> None:
    from attn_probe.extraction import UnsupportedModelError

    model = TuneModel(n_layers=1)
    model.layers[0]["attn"].q_proj.weight_fake_quantizer = nn.Hardtanh()  # any non-identity module
    with pytest.raises(UnsupportedModelError, match="fake-quantized"):
        score_model(model)


def test_torchtune_adapters_live_probe_follows_disabled(tmp_path) -> None:
    """The live probe reads the flag at each snapshot: DPO's reference pass disables the adapters."""
    import attn_probe
    from attn_probe import load_trajectory

    model = perturb(TuneModel(n_layers=1), seed=7)
    attn = model.layers[0]["attn"]
    ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: only the flag changes
    want = []
    with attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=1):
        for step in range(2):
            attn.q_proj.disabled = attn.k_proj.disabled = bool(step)
            want.append(symmetry64(tune_own(attn)))
            model(ids).sum().backward()
            opt.step()
            opt.zero_grad()
    table = load_trajectory(tmp_path)
    table = table[(table["metric"] == "symmetry") & table["head"].isna()]
    got = dict(zip(table["step"].astype(int), table["value"], strict=True))
    assert want[0] != pytest.approx(want[1], abs=1e-4)
    assert got[1] == pytest.approx(want[0], abs=1e-6) and got[2] == pytest.approx(want[1], abs=1e-6)


# --------------------------------------------------------------------------- the real packages
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "QKVLinear"])
def test_real_torchtitan_gqattention(fuse: bool) -> None:
    config_utils = pytest.importorskip("torchtitan.models.common.config_utils")
    from torchtitan.models.common import ComplexRoPE

    cfg = config_utils.make_gqa_config(
        dim=32, n_heads=8, n_kv_heads=2, wqkv_param_init={"weight": nn.init.normal_},
        wo_param_init={"weight": nn.init.normal_}, inner_attention=config_utils.get_attention_config("flex"),
        rope=ComplexRoPE.Config(dim=4, max_seq_len=64), fuse_qkv=fuse)
    model = nn.ModuleList([nn.ModuleDict({"attention": cfg.build()}) for _ in range(2)])
    model = perturb(model, seed=21)
    attns = [b["attention"] for b in model]
    assert type(attns[0].qkv_linear).__name__ == ("FusedQKVLinear" if fuse else "QKVLinear")
    assert_equal_own(model, attns, titan_own)
    # the shaped module computes what the real one does, on the same weights
    shaped = (FusedQKVLinear if fuse else QKVLinear)(32, 8, 2, 4).double()
    with torch.no_grad():
        for name, p in shaped.named_parameters():
            p.copy_(attns[0].qkv_linear.get_parameter(name))
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    for got, want in zip(shaped(x), attns[0].qkv_linear(x), strict=True):
        assert torch.allclose(got, want)


@pytest.mark.parametrize(("dora", "quantize"), [(False, False), (True, False), (False, True), (True, True)],
                         ids=["lora", "dora", "qlora", "qdora"])
def test_real_torchtune_lora_llama3(dora: bool, quantize: bool) -> None:
    llama3 = pytest.importorskip("torchtune.models.llama3")
    from torchtune.modules.peft import disable_adapter

    torch.manual_seed(4)
    kv = 4 if quantize else 2  # NF4 quantizes 64-value blocks, their scalers in blocks of 256
    model = llama3.lora_llama3(lora_attn_modules=["q_proj", "k_proj", "v_proj"], vocab_size=64, num_layers=2,
                               num_heads=4, num_kv_heads=kv, embed_dim=128, max_seq_len=64, lora_rank=4,
                               lora_alpha=8.0, use_dora=dora, quantize_base=quantize)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "magnitude" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "magnitude" in name else 0.0))
    attns = [layer.attn for layer in model.layers]
    assert type(attns[0].q_proj).__name__ == ("DoRALinear" if dora else "LoRALinear")
    assert type(attns[0].q_proj.weight).__name__ == ("NF4Tensor" if quantize else "Parameter")
    tol = 1e-5  # float32 (NF4 dequantizes to float32 here): the reference runs the module in float32

    def own32(attn):
        d, dh = attn.embed_dim, attn.head_dim
        eye = torch.eye(d)
        with torch.no_grad():
            return own_matrix(attn.q_proj(eye).view(d, attn.num_heads, dh), attn.k_proj(eye).view(d, -1, dh))

    layers = find_attention(model)
    assert_equal_own(model, attns, own32, layers, tol=tol, score_tol=1e-5)
    with disable_adapter(model):
        assert attns[0].q_proj.disabled
        assert_equal_own(model, attns, own32, layers, tol=tol, score_tol=1e-5)
    if not quantize:  # the shaped module computes what the real one does, on the same weights
        shaped = (DoRALinear if dora else LoRALinear)(128, 128, 4, 8.0)
        shaped.load_state_dict(attns[0].q_proj.state_dict())
        x = torch.randn(3, 128)
        assert torch.allclose(shaped(x), attns[0].q_proj(x), atol=1e-5)
