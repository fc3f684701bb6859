"""The errors lightning-parallel raises, in one place, and the rule for which one.

- A setting or an input the user can change (a strategy argument, the model, a batch, a file) that cannot be
  honoured raises a ``ValueError`` naming the numbers and the argument that fixes it, on every rank alike and
  before the first collective where possible. Its kinds below say what failed, so that a caller can tell them
  apart; each is a ``ValueError``, so ``except ValueError`` catches them all.
- A step that stops running (a rank that failed, a collective past its bound) raises a ``RuntimeError``.
"""

from __future__ import annotations


class ConfigurationError(ValueError):
    """The configuration cannot run on this block whatever its anatomy (a sequence length or head count that
    does not divide, weights loaded where they would be lost): raised as it is, never taken as a reason to try
    another source of anatomy."""


class AnatomyError(ValueError):
    """No source of anatomy could serve a block: names the block, each source tried and why it failed."""


class VerificationError(ValueError):
    """A transformed block differs from the block's own forward (or another rank found that it does)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: partial, corrupt, or from another model."""


class TrunkCallError(RuntimeError):
    """The step does not call the trunk the way pipelining needs (once, in order, hidden state chained)."""


class Unsupported(Exception):
    """A source of anatomy cannot provide what this configuration needs; the message says why. Internal: the
    resolution tries the next source, and an :class:`AnatomyError` reaches the user."""


__all__ = [
    "AnatomyError", "CheckpointError", "ConfigurationError", "TrunkCallError", "Unsupported", "VerificationError",
]  # fmt: skip
