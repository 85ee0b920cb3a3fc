"""Version of the rl-sglang distribution (one lockstep train while 0.x)."""

__version__ = "0.1.0"
