"""rl-weightsync."""
