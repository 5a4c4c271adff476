"""Measured attention statistics: what the attention logits of a training forward do.

- :mod:`.statistics`: the maths (max |logit|, entropy, logit bounds) and the capture of the
  query and key tensors of a training forward;
- :mod:`.registry`: how the capture reaches transformers' attention functions (its public
  ``AttentionInterface``), without importing anything of the rest of the package.
"""
