"""The live probe: what runs beside training.

- :mod:`.probe`: :class:`~attn_probe.live.probe.Probe`, the façade over the stages;
- :mod:`.stages`: the step decision, the measurement, the attention statistics, the alerting,
  the outputs (the snapshot assembly they share with post-hoc scoring is
  :mod:`attn_probe.sinks.assembly`);
- :mod:`.config`: :class:`~attn_probe.live.config.ProbeConfig`, every option in one place;
- :mod:`.schedules`, :mod:`.counting`: when a snapshot is due, and what counts as a step;
- :mod:`.asynchronous`: scoring off the training thread;
- :mod:`.images`, :mod:`.alerts`: the heatmap quantity, the alert rules;
- :mod:`.resume_policy`: what a resumed, branched or fresh run does with its directory.
"""
