"""Errors raised by the framework.

Every user-facing error is a subclass of :class:`RLError`. Messages name the file, field, line or
sample at fault and say how to fix it, e.g.::

    ConfigError: trainer.rollout.n_samples: expected int, got 'four' (str). Set an integer >= 1.
"""

from __future__ import annotations

__all__ = [
    "BackendNotFoundError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "GenerationError",
    "RLError",
    "RewardError",
    "WeightSyncError",
]


class RLError(Exception):
    """Base class of every error this framework raises on purpose."""


class ConfigError(RLError, ValueError):
    """A configuration value is unknown, missing or of the wrong type; the message names its path."""


class BackendNotFoundError(RLError, LookupError):
    """A backend or plugin name does not resolve to an entry point or a ``module:attr`` object."""


class DataError(RLError, ValueError):
    """A data file or sample is malformed; the message names the file and line or the sample id."""


class GenerationError(RLError, RuntimeError):
    """A generator could not serve a request (engine down, bad request, wrong weight version)."""


class RewardError(RLError, RuntimeError):
    """A reward function raised or returned a value that is not a finite number."""


class WeightSyncError(RLError, RuntimeError):
    """A weight update is corrupt, truncated, out of order or for the wrong base version.

    The receiver stays on its previous, intact version when this is raised.
    """


class CheckpointError(RLError, RuntimeError):
    """A checkpoint is missing, incomplete or does not match the run that tries to load it."""
