"""Version of the rl-tinker distribution (one lockstep train while 0.x)."""

__version__ = "0.1.0"
