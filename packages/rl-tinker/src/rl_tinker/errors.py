"""The service's own error: a request it cannot run as asked."""

from __future__ import annotations

from rl_core.errors import ConfigError

__all__ = ["UserError"]


class UserError(ConfigError):
    """A request the service cannot run as asked (unknown loss, missing input, bad shape):
    answered as a failed future (category ``user``) or a 4xx, never a crash of the service."""
