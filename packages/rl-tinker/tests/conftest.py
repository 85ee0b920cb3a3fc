"""Fixtures: a tiny built model and services driven by the official tinker SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("peft")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-style model with the project's byte-level tokenizer."""
    from rl_hf.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True)
def _api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK requires a key with its prefix; the service checks it only when configured to.
    monkeypatch.setenv("TINKER_API_KEY", "tml-local-test")


@pytest.fixture
def serve(tiny_model: Path, tmp_path: Path) -> Iterator:
    """``serve(**overrides) -> RunningService`` on a free port; all stopped after the test."""
    from rl_tinker.config import ServiceConfig
    from rl_tinker.runner import start

    running = []

    def make(**overrides):
        fields = {
            "models": {"tiny": str(tiny_model)},
            "state_dir": str(tmp_path / "state"),
            "port": 0,
        }
        fields.update(overrides)
        svc = start(ServiceConfig(**fields))
        running.append(svc)
        return svc

    yield make
    for svc in running:
        svc.stop()
