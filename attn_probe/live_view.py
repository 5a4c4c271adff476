"""The TensorBoard command the probe prints for its live view, built in one place.

TensorBoard's server downsamples every scalar tag to ``--samples_per_plugin scalars=N`` points
when it serves them (1,000 without the flag). ``N = 0`` keeps *nothing* (TensorBoard 2.21 serves
empty series), so the printed command names an explicit, large, finite ``N``: every run with at
most ``N`` points per tag is shown whole, and ``N`` bounds the server's memory per tag. Values
above ``2**63 - 1`` make TensorBoard fall back to its slow loader.
"""

from __future__ import annotations

import os
import shlex

__all__ = ["SCALARS_PER_TAG", "tensorboard_command"]

#: Points per scalar tag the printed live view keeps (all of them for runs up to this length).
SCALARS_PER_TAG = 1_000_000


def tensorboard_command(log_dir: str | os.PathLike[str]) -> str:
    """``tensorboard --logdir DIR --samples_per_plugin scalars=N``, with ``DIR`` shell-quoted."""
    return f"tensorboard --logdir {shlex.quote(os.fspath(log_dir))} --samples_per_plugin scalars={SCALARS_PER_TAG}"
