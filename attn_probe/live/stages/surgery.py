"""Part of stage 2: has the model changed since attach (model surgery)? Identity comparisons only.

At attach, per layer, the module at its path, the module owning each scored parameter, the
parameter registered there, and the adapters attached to its LoRA projections are recorded;
:meth:`SurgeryCheck.changed_layers` compares them at every snapshot (a few ``getattr`` per
layer), and :meth:`SurgeryCheck.refind` finds the attention layers again, with a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ...extraction import AttentionLayer, find_attention, unwrap
from ...isolation import safe_warn

__all__ = ["SurgeryCheck"]


def _submodule(module: nn.Module, path: str) -> nn.Module:
    """``module.get_submodule(path)`` by dictionary lookups (a few hundred ns per segment)."""
    for item in path.split(".") if path else ():
        child = module._modules.get(item)
        module = child if child is not None else getattr(module, item)  # AttributeError: gone
    return module


class SurgeryCheck:
    """The identities of the attached layers and their scored parameters, and the check against them.

    ``param_names(layer)``: the parameters scored on ``layer`` (those the walk gathers).
    """

    def __init__(self, model: nn.Module, param_names: Callable[[AttentionLayer], tuple[str, ...]]) -> None:
        self.model = model
        self.param_names = param_names
        self._identities: list[tuple[AttentionLayer, Any, list[tuple[bool, str, Any, str, Any]], Any]] = []

    def record(self, layers: list[AttentionLayer]) -> None:
        """Record the identities of ``layers`` (unresolvable names: no check; snapshots will say so)."""
        try:
            self._identities = self._identities_of(layers)
        except Exception:  # noqa: BLE001
            self._identities = []

    def _identities_of(self, layers: list[AttentionLayer]) -> list[Any]:
        root = unwrap(self.model)
        out = []
        for layer in layers:
            module = layer.module
            prefix = f"{layer.name}." if layer.name else ""
            refs = []
            for name in self.param_names(layer):
                on_layer = module is not None and name.startswith(prefix)
                rel = name[len(prefix):] if on_layer else name
                path, _, attr = rel.rpartition(".")
                base = module if on_layer else root
                owner = base.get_submodule(path) if path else base
                refs.append((on_layer, path, owner, attr, owner._parameters.get(attr)))
            out.append((layer, module, refs, layer.attached_adapters()))
        return out

    def changed_layers(self) -> list[str]:
        """Attached layers whose module, or whose scored parameters, are no longer those of attach time.

        The module at each attached path, the module owning each scored parameter, the parameter
        registered there; and the names of the adapters attached to its LoRA projections (one
        added after attach has parameters the layer does not declare). Which adapter is active,
        merged or disabled is read with the weights, at every snapshot.
        """
        root = unwrap(self.model)
        changed = []
        for layer, module, refs, adapters in self._identities:
            try:
                same = module is None or _submodule(root, layer.name) is module
                same = same and layer.attached_adapters() == adapters
                for on_layer, path, owner, attr, param in refs if same else ():
                    current = _submodule(module if on_layer else root, path)
                    if current is not owner or current._parameters.get(attr) is not param:
                        same = False
                        break
            except AttributeError:  # the path is gone (a deleted layer)
                same = False
            if not same:
                changed.append(layer.name)
        return changed

    def refind(self, before: list[AttentionLayer], changed: list[str], *, groups: Any, layers: Any,
               find_kwargs: dict[str, Any]) -> list[AttentionLayer]:
        """Find the attention layers again (``find_attention`` with the probe's options), record
        them, and warn naming what changed; ``[]`` when none is left."""
        try:
            found = find_attention(self.model, groups=groups, layers=layers, **find_kwargs)
        except Exception:  # noqa: BLE001 - UnsupportedModelError: nothing left to read
            found = []
        self._identities = self._identities_of(found)
        names_before = [a.name for a in before]
        now = [a.name for a in found]
        gone = [n for n in names_before if n not in now]
        new = [n for n in now if n not in names_before]
        safe_warn(
            "attn_probe: the model changed after attach: "
            f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} no longer the module (or q/k "
            "parameters) found at attach. The probe found the attention layers again: "
            f"{len(found)} layer{'s' if len(found) != 1 else ''} now"
            + (f"; gone: {', '.join(gone)}" if gone else "")
            + (f"; new: {', '.join(new)}" if new else "")
            + ". Values from this snapshot on are those of the live modules."
            + ("" if found else " Nothing is logged until attention layers are found again.")
        )
        return found
