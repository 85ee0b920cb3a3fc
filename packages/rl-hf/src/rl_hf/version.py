"""Version of the rl-hf distribution (one lockstep train while 0.x)."""

__version__ = "0.1.0"
