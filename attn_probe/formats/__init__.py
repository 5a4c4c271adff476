"""The files a probe run writes, one module per format, each the one home of its encoding.

- :mod:`attn_probe.formats.trajectory`: the lossless trajectory file ``attn_probe.jsonl``
  (record encoding, the run header, scanning for runs, the resume cut).
- :mod:`attn_probe.formats.events`: TensorBoard event files on disk (which files, the record
  framing, cutting a torn record, checking checksums).

Used by the sinks (writing), the resume (cutting back) and :mod:`attn_probe.analysis`
(reading). Standard library only at import time.
"""
