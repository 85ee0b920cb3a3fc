"""Repository-wide pytest hooks: ``gpu``-marked tests are skipped where CUDA is unavailable.

``make test`` (CPU) therefore collects the GPU tier and reports it as skipped; ``make test-gpu``
runs only that tier (``-m gpu``) on a machine with CUDA (README, "Test tiers").
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test when ``torch.cuda.is_available()`` is False."""
    if not any("gpu" in item.keywords for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (run `make test-gpu` on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
