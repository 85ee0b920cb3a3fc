"""A recipe's SGLang topology (``generator: {type: sglang_topology}``) is validated at start-up
with the run's model as the policy groups' model, and refused on Ray engine actors. No server
is started (the end-to-end run is tests/test_e2e_sglang_topology.py)."""

from __future__ import annotations

import pytest

from rl_core.errors import ConfigError
from rl_trainer.build import backend_spec, validate_backends
from rl_trainer.config import load_trainer_config

# The entry point name ``sglang_topology`` once rl-sglang is installed; the module reference
# resolves the same class without relying on the installed metadata.
TOPOLOGY = "rl_sglang.topology:SGLangTopology"
GROUPS = [{"name": "policy"}, {"name": "judge", "serves_policy": False}]


def test_policy_groups_serve_the_runs_model(tiny_recipe_dict, tmp_path) -> None:
    cfg = load_trainer_config(
        tiny_recipe_dict(tmp_path, generator={"type": TOPOLOGY, "groups": GROUPS})
    )
    validate_backends(cfg, "/runs/x/init_model")
    spec = backend_spec(cfg, "generator", "/runs/x/init_model")
    assert spec.options["model_path"] == "/runs/x/init_model"
    bad = {"type": TOPOLOGY, "groups": [*GROUPS, {"name": "judge", "num_servers": 2}]}
    cfg = load_trainer_config(tiny_recipe_dict(tmp_path, generator=bad))
    with pytest.raises(ConfigError, match=r"generator.groups\[2\].name: 'judge' is already"):
        validate_backends(cfg, "/runs/x/init_model")


def test_refused_on_ray_engine_actors(tiny_recipe_dict, tmp_path) -> None:
    """Every engine actor would launch the whole topology: the recipe must run it in the
    driver (``runtime.generator.count: 0``)."""
    cfg = load_trainer_config(
        tiny_recipe_dict(
            tmp_path,
            generator={"type": TOPOLOGY, "groups": GROUPS},
            runtime={"type": "ray", "generator": {"count": 2}},
        )
    )
    with pytest.raises(ConfigError, match="runtime.generator.count: 2 engine actors") as info:
        validate_backends(cfg, "/runs/x/init_model")
    assert "set runtime.generator.count: 0" in str(info.value)
