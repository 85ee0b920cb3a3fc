"""Plugin registry: entry points, module:attr, local registrations, option validation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import BackendNotFoundError, ConfigError


class Widget:
    @dataclass(kw_only=True, slots=True)
    class Config:
        size: int = 1

    def __init__(self, config: Config, *, label: str = "") -> None:
        self.config = config
        self.label = label


def plain_reward(prompt, response, rollout):
    return 1.0


def test_module_attr_and_options():
    w = registry.build(
        "policy", ComponentSpec(type=f"{__name__}:Widget", options={"size": 3}), label="x"
    )
    assert isinstance(w, Widget) and w.config.size == 3 and w.label == "x"
    with pytest.raises(ConfigError, match="policy.colour: unknown field of Config"):
        registry.build(
            "policy",
            ComponentSpec(type=f"{__name__}:Widget", options={"colour": 1}),
            field="policy",
        )
    assert registry.build("reward", f"{__name__}:plain_reward") is plain_reward
    with pytest.raises(ConfigError, match="takes no options"):
        registry.build(
            "reward",
            ComponentSpec(type=f"{__name__}:plain_reward", options={"a": 1}),
            field="reward",
        )


def test_unknown_names_are_clear():
    with pytest.raises(
        BackendNotFoundError, match=r"policy.type: unknown rl.policies backend 'nope'"
    ):
        registry.build("policy", "nope", field="policy")
    with pytest.raises(BackendNotFoundError, match="cannot import module"):
        registry.resolve("rl.rewards", "no_such_module_xyz:f")
    with pytest.raises(BackendNotFoundError, match="has no attribute"):
        registry.resolve("rl.rewards", f"{__name__}:missing")


def test_entry_points_resolve():
    from rl_core.algorithms.advantages import GRPO
    from rl_core.rewards.text import ExactMatch

    assert "grpo" in registry.available("rl.advantages")
    assert registry.resolve("rl.advantages", "grpo") is GRPO
    assert registry.resolve("rl.rewards", "exact_match") is ExactMatch


def test_local_registration():
    registry.register("rl.rewards", "local_test_reward", plain_reward)
    assert registry.resolve("rl.rewards", "local_test_reward") is plain_reward


def test_check_callable_signature():
    registry.check_callable(plain_reward, object, field="reward", n_args=3)
    with pytest.raises(ConfigError, match="does not match"):
        registry.check_callable(lambda a: a, object, field="reward", n_args=3)
    with pytest.raises(ConfigError, match="not callable"):
        registry.check_callable(3, object, field="reward")
