"""Fixtures: a tiny built model and services driven by the official tinker SDK."""

from __future__ import annotations

import warnings
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


def _close_clients(clients: list, url: str) -> None:
    """Close (finish) every tinker ServiceClient of ``url`` while its service still answers: the
    SDK's session heartbeat would otherwise run on in its event-loop thread after the service
    stops and warn "Session heartbeat failed" minutes later. A closed client is left alone."""
    for sc in [c for c in clients if (c._base_url or "").rstrip("/") == url.rstrip("/")]:
        clients.remove(sc)
        try:
            sc.close("success").result(timeout=30)
        except TimeoutError:  # the test goes on; the SDK finishes closing in its own thread
            warnings.warn(f"tinker client of {url} not closed within 30 s", stacklevel=1)


@pytest.fixture
def serve(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``serve(**overrides) -> RunningService`` on a free port; all stopped after the test.
    The SDK clients made during the test (``tinker.ServiceClient``, also inside the cookbook) are
    closed when their service stops, by the test or after it."""
    import tinker
    from rl_tinker.config import ServiceConfig
    from rl_tinker.runner import start

    running = []
    clients: list = []
    real_init = tinker.ServiceClient.__init__

    def tracked_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        clients.append(self)

    monkeypatch.setattr(tinker.ServiceClient, "__init__", tracked_init)

    def make(**overrides):
        fields = {
            "models": {"tiny": str(tiny_model)},
            "state_dir": str(tmp_path / "state"),
            "port": 0,
        }
        fields.update(overrides)
        svc = start(ServiceConfig(**fields))
        real_stop = svc.stop

        def stop() -> None:
            try:
                _close_clients(clients, svc.url)
            finally:
                real_stop()

        svc.stop = stop
        running.append(svc)
        return svc

    yield make
    for svc in running:
        svc.stop()
