"""``rl-tinker serve``: a bad config ends with a message naming the field, not a traceback."""

from __future__ import annotations

from rl_tinker.cli import main


def test_serve_rejects_a_bad_config_naming_the_field(tmp_path, capsys):
    cfg = tmp_path / "svc.yaml"
    cfg.write_text("models: {tiny: /nowhere}\nstate_dir: x\nport: 70000\n")
    assert main(["serve", str(cfg)]) == 2
    assert "port" in capsys.readouterr().err


def test_serve_rejects_a_model_directory_without_config(tmp_path):
    """The base model loads on first use; a directory without config.json is a ConfigError
    naming the ``models`` entry (answered 400 over HTTP)."""
    import pytest
    from rl_tinker.config import ServiceConfig
    from rl_tinker.server import TinkerService

    from rl_core.errors import ConfigError

    svc = TinkerService(
        ServiceConfig(models={"m": str(tmp_path / "none")}, state_dir=str(tmp_path / "s"))
    )
    try:
        with pytest.raises(ConfigError, match="models.m"):
            svc.base("m")
    finally:
        svc.close()
