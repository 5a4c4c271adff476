"""``torch.nn.Transformer``: which of its attention modules the probe reports as cross-attention.

The reference is the model's own forward: a module is cross-attention when the keys it receives
are the encoder's output (``memory``), not its own input.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import attn_probe
from attn_probe.extraction import find_attention


class Records:
    """A sink keeping the snapshots' records."""

    def __init__(self) -> None:
        self.records = []

    def start(self, run) -> None:
        pass

    def log(self, snapshot) -> None:
        self.records.extend(snapshot.records)

    def finish(self) -> None:
        pass


def _transformer() -> nn.Transformer:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on enable_nested_tensor
        return nn.Transformer(
            d_model=16,
            nhead=2,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=32,
            dropout=0.0,
            batch_first=True,
        )


def test_nn_transformer_cross_attention_is_grouped_as_cross(tmp_path):
    """Issue 44: the decoder's cross-attention (``multihead_attn``) was grouped as ``self``, and with it
    every layer of the model (on 70bdcc9: six 'self' layers). Now the probe reports as ``cross``
    exactly the modules whose keys, in the model's own forward, are the encoder's output."""
    model = _transformer()
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    keys = {}

    def record(name):
        def hook(module, args, kwargs):
            keys[name] = args[1] if len(args) > 1 else kwargs["key"]

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            module.register_forward_pre_hook(record(name), with_kwargs=True)
    with torch.no_grad():
        memory = model.encoder(src)
        keys.clear()
        model(src, tgt)
    cross_by_forward = {
        name for name, k in keys.items() if k.shape == memory.shape and torch.equal(k, memory)
    }
    assert cross_by_forward == {"decoder.layers.0.multihead_attn", "decoder.layers.1.multihead_attn"}

    layers = find_attention(model)
    assert {a.name for a in layers if a.group == "cross"} == cross_by_forward
    assert [(a.name, a.group, a.layer) for a in layers] == [
        ("encoder.layers.0.self_attn", "encoder", 0),
        ("encoder.layers.1.self_attn", "encoder", 1),
        ("decoder.layers.0.self_attn", "decoder", 0),
        ("decoder.layers.0.multihead_attn", "cross", 0),
        ("decoder.layers.1.self_attn", "decoder", 1),
        ("decoder.layers.1.multihead_attn", "cross", 1),
    ]
    # what the probe writes: the cross layers' rows under the cross group
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(model, optimizer=opt, every=1, sinks=[sink], log_dir=str(tmp_path / "tb"))
    model(src, tgt).sum().backward()
    opt.step()
    probe.close()
    assert {(r.group, r.layer) for r in sink.records if r.metric == "symmetry"} == {
        (group, layer) for group in ("encoder", "decoder", "cross") for layer in (0, 1)
    }


def test_an_encoder_only_stack_stays_self():
    """Only torch's encoder layers (no decoder layer): a single stack, as before."""
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.TransformerEncoder(layer, num_layers=2)
    assert [(a.group, a.layer) for a in find_attention(model)] == [("self", 0), ("self", 1)]
