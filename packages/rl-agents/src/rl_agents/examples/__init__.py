"""Worked examples of the extension seams (custom rollouts, tools, rewards), importable and
tested, so they can be named in a recipe as ``"rl_agents.examples.<module>:<name>"``."""
