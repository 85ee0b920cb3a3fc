"""rl-buffer."""
