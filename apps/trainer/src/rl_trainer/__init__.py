"""rl-trainer: the thin reference trainer app."""
