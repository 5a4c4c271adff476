"""The TensorBoard command the probe prints for its live view, built in one place.

TensorBoard's server downsamples every scalar tag to ``--samples_per_plugin scalars=N`` points
when it serves them (1,000 without the flag). ``N = 0`` keeps *nothing* (TensorBoard 2.21 serves
empty series), so the printed command names an explicit, large, finite ``N``: every run with at
most ``N`` points per tag is shown whole, and ``N`` bounds the server's memory per tag. Values
above ``2**63 - 1`` make TensorBoard fall back to its slow loader.

TensorBoard names a run by its directory relative to ``--logdir``: a run directory given as the
``--logdir`` itself is the run ``.``. So the command for one run names the run's parent
(:func:`run_command`), where the run has its own name (and its sibling runs are beside it).
The paper's figure is the first chart of the Custom Scalars dashboard (:func:`figure_url`).
"""

from __future__ import annotations

import os
import shlex

__all__ = ["SCALARS_PER_TAG", "TENSORBOARD_PORT", "figure_url", "run_command", "tensorboard_command"]

#: Points per scalar tag the printed live view keeps (all of them for runs up to this length).
SCALARS_PER_TAG = 1_000_000

#: the port TensorBoard listens on when it is free (it takes the next free one otherwise, and says so)
TENSORBOARD_PORT = 6006


def tensorboard_command(log_dir: str | os.PathLike[str]) -> str:
    """``tensorboard --logdir DIR --samples_per_plugin scalars=N``, with ``DIR`` shell-quoted."""
    return f"tensorboard --logdir {shlex.quote(os.fspath(log_dir))} --samples_per_plugin scalars={SCALARS_PER_TAG}"


def run_command(run_dir: str | os.PathLike[str]) -> str:
    """:func:`tensorboard_command` of the directory holding ``run_dir``: there the run is named
    ``run_dir``'s last part, not ``.``."""
    path = os.path.normpath(os.fspath(run_dir))
    if os.path.basename(path) in ("", os.curdir, os.pardir):  # "." or "..": its name is in the absolute path
        path = os.path.abspath(path)
    return tensorboard_command(os.path.dirname(path) or os.curdir)


def figure_url(port: int = TENSORBOARD_PORT) -> str:
    """The address of TensorBoard's Custom Scalars dashboard, whose first chart is the paper's figure."""
    return f"http://localhost:{port}/#custom_scalars"
