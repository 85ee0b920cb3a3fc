"""rl-megatron."""
