"""The live probe's stages, run in this order by the façade :class:`attn_probe.live.probe.Probe`.

1. :mod:`~attn_probe.live.stages.decision`: is this step due (scores, images), is it newer than the
   last snapshot, and on a sharded run do all ranks agree (:class:`StepDecision`);
2. :mod:`~attn_probe.live.stages.measurement`: the model-surgery check
   (:mod:`~attn_probe.live.stages.surgery`), the walk over the layers (gathering what the pairs
   declare), their factors, the scoring core, and the asynchronous mode
   (:class:`Measurement`); it returns the values moved to the host (:class:`Measured`);
3. :mod:`~attn_probe.sinks.assembly`: host tables -> records -> across-layer statistics ->
   :class:`~attn_probe.sinks.Snapshot` (also used by checkpoint trajectories);
4. :mod:`~attn_probe.live.stages.outputs`: the log directory and its lock, the sinks and their
   dispatcher (every use of the sinks by the probe is there).

Each stage is built from plain values (the :class:`~attn_probe.live.config.ProbeConfig`, the
model, the layers, the agreement group) and returns plain values; no stage receives the
probe or imports another stage. Failures are reported through :mod:`attn_probe.isolation`.
This package's ``__init__`` imports nothing, so ``attn_probe.sinks.assembly`` stays light.
"""
