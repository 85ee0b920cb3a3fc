"""Recipes that run ``tinker-cookbook`` code unmodified against this service (docs/service.md)."""
