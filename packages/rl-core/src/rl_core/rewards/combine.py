"""Weighted sums of named reward components.

:class:`Combine` calls every component on the same rollout (async ones concurrently) and returns
all of them plus their weighted sum under ``"reward"``::

    {"correct": 1.0, "format": 0.0, "reward": 1.0 * 1.0 + 0.1 * 0.0}

A component that returns a mapping contributes its ``"reward"`` entry as its value, and its other
entries as ``"<name>/<key>"``. A component that raises, or returns a value that is not a finite
number, makes the whole reward fail (the trainer marks the rollout failed and counts it): a
partial sum would be a silently wrong reward.

In a recipe (TOML)::

    [reward]
    type = "combine"
    [reward.components.correct]
    reward = {type = "math_equiv"}
    weight = 1.0
    [reward.components.format]
    reward = {type = "format_match", pattern = "\\\\boxed\\\\{.+\\\\}"}
    weight = 0.1

In code: ``Combine.of(correct=(MathEquiv(), 1.0), format=(FormatMatch(...), 0.1))``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from rl_core.config import ComponentSpec, Range
from rl_core.errors import ConfigError, RewardError
from rl_core.interfaces import RewardFn
from rl_core.types import Prompt, Rollout

__all__ = ["Combine", "CombineComponent"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CombineComponent:
    """One component of :class:`Combine`: a reward (by registry name and options) and its weight."""

    reward: ComponentSpec
    """The reward function: an ``rl.rewards`` name or ``"module:attr"``, plus its options."""
    weight: Annotated[float, Range()] = 1.0
    """Weight of this component in the sum (may be negative, e.g. a length penalty)."""


def _check_name(name: str) -> None:
    if not name or name == "reward" or "/" in name:
        raise ConfigError(
            f"reward.components.{name}: component names must be non-empty, not 'reward' (the "
            "sum's key) and contain no '/'; rename it."
        )


class Combine:
    """Weighted sum of named reward components (see the module docstring).

    Registered as ``combine``. Async: returns a coroutine of the mapping.
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`Combine`."""

        components: dict[str, CombineComponent] = field(default_factory=dict)
        """Component name -> reward and weight; at least one."""

        def __post_init__(self) -> None:
            if not self.components:
                raise ConfigError(
                    "reward.components: give at least one component, e.g. "
                    "{correct = {reward = {type = 'exact_match'}, weight = 1.0}}."
                )
            for name, comp in self.components.items():
                _check_name(name)
                if not math.isfinite(comp.weight):
                    raise ConfigError(
                        f"reward.components.{name}.weight: must be finite, got {comp.weight}."
                    )

    def __init__(self, config: Config) -> None:
        from rl_core import registry

        self.config = config
        self.components: dict[str, tuple[RewardFn, float]] = {
            name: (
                registry.build("reward", comp.reward, field=f"reward.components.{name}.reward"),
                float(comp.weight),
            )
            for name, comp in config.components.items()
        }
        for name, (fn, _) in self.components.items():
            registry.check_callable(
                fn, RewardFn, field=f"reward.components.{name}.reward", n_args=3
            )

    @classmethod
    def of(cls, **components: tuple[RewardFn, float]) -> Combine:
        """Build from reward functions in code: ``Combine.of(name=(fn, weight), ...)``."""
        if not components:
            raise ConfigError("Combine.of: give at least one name=(reward_fn, weight).")
        self = cls.__new__(cls)
        self.config = None  # type: ignore[assignment]
        self.components = {}
        for name, pair in components.items():
            _check_name(name)
            if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[0])):
                raise ConfigError(
                    f"Combine.of: {name}= must be a (reward_fn, weight) pair, got {pair!r}."
                )
            fn, weight = pair
            if not math.isfinite(float(weight)):
                raise ConfigError(f"Combine.of: {name} weight must be finite, got {weight}.")
            self.components[name] = (fn, float(weight))
        return self

    async def __call__(
        self, prompt: Prompt, response: str, rollout: Rollout | None = None
    ) -> dict[str, float]:
        """Score every component and return them with their weighted sum under ``"reward"``."""

        async def one(fn: RewardFn) -> Any:
            value = fn(prompt, response, rollout)
            return await value if inspect.isawaitable(value) else value

        names = list(self.components)
        values = await asyncio.gather(*(one(self.components[n][0]) for n in names))
        out: dict[str, float] = {}
        total = 0.0
        for name, value in zip(names, values, strict=True):
            if isinstance(value, Mapping):
                if "reward" not in value:
                    raise RewardError(
                        f"combine: component {name!r} returned a mapping without a 'reward' key "
                        f"(keys: {sorted(value)}); return one."
                    )
                for k, v in value.items():
                    if k != "reward":
                        out[f"{name}/{k}"] = _finite(v, f"{name}/{k}")
                value = value["reward"]
            v = _finite(value, name)
            out[name] = v
            total += self.components[name][1] * v
        out["reward"] = total
        return out


def _finite(value: Any, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"combine: component {name!r} returned {value!r}; it must return a number."
        ) from None
    if not math.isfinite(v):
        raise RewardError(f"combine: component {name!r} returned {v}; rewards must be finite.")
    return v
