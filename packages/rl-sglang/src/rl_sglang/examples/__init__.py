"""Examples of rollout functions that use rl-sglang features (server groups)."""
