"""Moved to :mod:`helpers` (the one shared helpers module); kept for the tracker tests that still import it."""

from helpers import SEQ, VOCAB, RandomTokens, make_args, tiny_bert  # noqa: F401
