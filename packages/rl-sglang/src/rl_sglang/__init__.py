"""rl-sglang."""
