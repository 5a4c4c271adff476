"""``attn-probe models``: the attention layouts attn_probe reads without help, and how to add one.

What a pip user can open when a model is not recognised (the error message points here): the
list comes from the extraction registry (:func:`attn_probe.extraction.architectures.describe_layouts`),
not from a hand-written table.
"""

from __future__ import annotations

import argparse
import textwrap

#: printed after the list; tests run this code as printed
RECIPE = '''\
Custom models
  Separate query/key children (any names):
    attn_probe.watch(model, ..., find_kwargs={"qk_names": [("my_q", "my_k")]})
    attn_probe.attach(trainer, ..., find_kwargs={"qk_names": [("my_q", "my_k")]})
    attn_probe.find_attention(model, qk_names=[("my_q", "my_k")])
  A fused or other layout: register an adapter before watch/attach (heads read from the module):

    from attn_probe import register_adapter
    from attn_probe.extraction.architectures import child_projection, contiguous_qkv

    @register_adapter
    def my_layout(module, path, config):
        """A QKLayout for MyAttention (rows of qkv: [q | k | v], head-major), else None."""
        if type(module).__name__ != "MyAttention":
            return None
        qkv = child_projection(module, path, "qkv")
        return contiguous_qkv(qkv, module.num_heads, module.num_heads, module.head_dim)

  Other layouts: return attn_probe.extraction.QKLayout(param_names, num_heads, num_kv_heads, head_dim,
  hidden_size, split) with split(get) -> (W_q (H, dh, d), W_k (H_kv, dh, d)), reading weights
  only through get(name).
'''


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, default=100, help="wrap the descriptions at this width (default 100)")


def run(args: argparse.Namespace) -> int:
    from ..extraction.architectures import describe_layouts

    print("Attention layouts attn_probe reads without an adapter (tried in this order per module):")
    for name, text in describe_layouts():
        print(f"\n  {name}")
        print(textwrap.fill(text.replace("``", "`"), width=max(args.width, 40), initial_indent="    ", subsequent_indent="    "))
    print()
    print(RECIPE, end="")
    return 0
