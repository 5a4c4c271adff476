"""torchtune's adapter projections (read from torchtune 0.6.1): the weight their forward computes with.

* ``LoRALinear``: ``W + (alpha / rank) * B @ A`` (``B = lora_b.weight``, ``A = lora_a.weight``).
* ``DoRALinear``: ``diag(m / ||W + s B A||_row) (W + s B A)`` with ``s = scaling`` and ``m = magnitude``:
  its forward scales the base output and the LoRA output by ``magnitude / weight_norm`` per output row.
* QLoRA (either one built with ``quantize_base=True``, and the frozen ``nn.Linear`` layers beside them):
  the base ``weight`` is a torchao ``NF4Tensor``, dequantized as the forward does
  (``get_original_weight()``, the tensor's public method).
* ``disabled = True`` (torchtune's ``disable_adapter`` context, used for DPO's reference pass): ``W``
  alone, as the forward returns the base output. ``merged`` is not read: torchtune's forward never
  reads it (merging happens on a state dict copy, ``get_merged_lora_ckpt``).

The flag is read each time the weight is, like PEFT's adapter state. Recognised by structure, not by
class name: a ``weight`` tensor, ``lora_a``/``lora_b`` ``nn.Linear`` children and a ``disabled`` flag
(PEFT's wrappers have ``lora_A``/``lora_B`` module dicts instead). ``QATLoRALinear`` with a fake quantizer
on its weight is refused: its forward computes with the fake-quantized weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .base import ParamGetter, Tensor, UnsupportedModelError


def dense(weight: Tensor, path: str) -> Tensor:
    """``weight`` as the floating-point matrix the forward multiplies by: a quantized tensor that
    offers a public ``get_original_weight()`` (torchao's ``NF4Tensor``) is dequantized."""
    if not isinstance(weight, torch.Tensor):
        return weight
    restore = getattr(weight, "get_original_weight", None)
    if callable(restore):
        return restore()
    if not weight.is_floating_point():
        raise UnsupportedModelError(
            f"{path}: weight is quantized ({type(weight).__name__}, {weight.dtype}); "
            "attn_probe reads floating-point projection weights only (dequantize or merge first)"
        )
    return weight


def is_torchtune_adapter(module: nn.Module) -> bool:
    """Whether ``module`` is shaped as torchtune's ``LoRALinear``/``DoRALinear``."""
    return (isinstance(getattr(module, "lora_a", None), nn.Linear)
            and isinstance(getattr(module, "lora_b", None), nn.Linear)
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and hasattr(module, "disabled"))


def torchtune_weight(module: nn.Module, path: str, prefix: str
                     ) -> tuple[tuple[str, ...], int, int, Callable[[ParamGetter], Tensor]]:
    """``(param_names, out_features, in_features, weight(get))`` of a torchtune adapter projection."""
    fake_quant = getattr(module, "weight_fake_quantizer", None)
    if isinstance(fake_quant, nn.Module) and not isinstance(fake_quant, nn.Identity):
        raise UnsupportedModelError(
            f"{path}: {type(module).__name__} computes with a fake-quantized weight (QAT); attn_probe reads "
            "the weight the forward uses and cannot reproduce the fake quantizer: score it without QAT"
        )
    w_name, a_name, b_name = f"{prefix}weight", f"{prefix}lora_a.weight", f"{prefix}lora_b.weight"
    dora = isinstance(getattr(module, "magnitude", None), torch.Tensor)
    m_name = f"{prefix}magnitude"
    names = (w_name, a_name, b_name) + ((m_name,) if dora else ())
    out_features, in_features = module.lora_b.out_features, module.lora_a.in_features

    def weight(get: ParamGetter) -> Tensor:
        base = dense(get(w_name), path)
        if module.disabled:
            return base
        a, b = get(a_name), get(b_name)
        dtype = torch.promote_types(base.dtype, a.dtype)
        scale = float(module.scaling) if dora else float(module.alpha) / float(module.rank)
        w = base.to(dtype) + scale * (b.to(dtype) @ a.to(dtype))
        if not dora:
            return w
        norm = torch.linalg.norm(w, dim=1)
        return (get(m_name).to(dtype) / norm).unsqueeze(1) * w

    return names, out_features, in_features, weight


__all__ = ["dense", "is_torchtune_adapter", "torchtune_weight"]
