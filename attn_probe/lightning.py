"""Short public path of the Lightning callback: ``from attn_probe.lightning import AttnProbeCallback``.

Imports ``lightning`` (the ``attn-probe[lightning]`` extra), else the older ``pytorch_lightning``; ``import attn_probe`` does not import this module.
"""

from __future__ import annotations

from .integrations.lightning import AttnProbeCallback

__all__ = ["AttnProbeCallback"]
