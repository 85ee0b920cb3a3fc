"""Checks of a recipe against what the ``ray`` runtime can run, and the helpers every Ray module
shares (component options, actor process set-up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import ConfigError

__all__ = ["FILE_TRANSPORTS", "check_ray_config", "setup_process", "spec_with"]


FILE_TRANSPORTS = ("rl_weightsync.disk_full", "rl_weightsync.disk_delta")
"""Modules of the weight transports that work through a shared filesystem: the only ones a run
with its generator in the driver (``runtime.generator.count: 0``) can use."""


def spec_with(kind: str, spec: ComponentSpec, **values: Any) -> ComponentSpec:
    """``spec`` with ``values`` set for the options its ``Config`` has (others are dropped)."""
    cls = registry.resolve(registry.GROUPS[kind], spec.type, field=f"{kind}.type")
    known = {f.name for f in dataclasses.fields(cls.Config)} if hasattr(cls, "Config") else set()
    extra = {k: v for k, v in values.items() if k in known}
    return ComponentSpec(type=spec.type, options={**spec.options, **extra})


def check_ray_config(config: Any, transport_spec: ComponentSpec) -> None:
    """Refuse settings the ``ray`` runtime cannot run, naming the field and the fix.

    ``config`` is the :class:`~rl_trainer.config.TrainerConfig`; ``transport_spec`` the weight
    transport's spec with its run defaults.
    """
    _check_layout(config.runtime, transport_spec)
    _check_transport(config.runtime, transport_spec)
    _check_model_ranks(config)


def _check_layout(rc: Any, transport_spec: ComponentSpec) -> None:
    """Actor counts, resources, layout and timeouts of ``runtime`` (``rc``)."""
    for role, least in (("policy", 1), ("generator", 0)):
        res = getattr(rc, role)
        if res.count < least or res.cpus < 0 or res.gpus < 0:
            raise ConfigError(
                f"runtime.{role}: count must be >= {least} and cpus/gpus >= 0, got {res}."
            )
    if rc.generator.count == 0:
        if rc.layout == "colocated":
            raise ConfigError(
                "runtime.generator.count: 0 (the generator runs in the driver) cannot share the "
                "policy ranks' bundles; use runtime.layout=disaggregated."
            )
        cls = registry.resolve(
            registry.GROUPS["weight_transport"], transport_spec.type, field="weight_transport.type"
        )
        if cls.__module__ not in FILE_TRANSPORTS:
            raise ConfigError(
                f"weight_transport.type: {transport_spec.type!r} with runtime.generator.count=0 "
                "(a generator in the driver, e.g. a client of external SGLang servers); use "
                "weight_transport: {type: disk_full} or {type: disk_delta} on a filesystem the "
                "policy rank and the servers share."
            )
    if rc.layout == "colocated" and rc.generator.count > rc.policy.count:
        raise ConfigError(
            f"runtime.generator.count: {rc.generator.count} generators cannot share the bundles "
            f"of {rc.policy.count} policy ranks (colocated layout); lower it to <= "
            "runtime.policy.count or use runtime.layout=disaggregated."
        )
    if rc.generate_timeout_s <= 0 or rc.max_generator_restarts < 0:
        raise ConfigError(
            "runtime.generate_timeout_s must be > 0 and runtime.max_generator_restarts >= 0."
        )


def _check_transport(rc: Any, transport_spec: ComponentSpec) -> None:
    """Refuse weight transports that cannot cross the runtime's processes."""
    cls = registry.resolve(
        registry.GROUPS["weight_transport"], transport_spec.type, field="weight_transport.type"
    )
    if cls.__module__ == "rl_weightsync.inprocess":
        raise ConfigError(
            "weight_transport.type: 'inprocess' moves weights inside one process, but on the ray "
            "runtime the policy and the generators are separate processes. Use "
            "weight_transport: {type: disk_full} or {type: disk_delta} (run_dir on a filesystem "
            "every node sees)."
        )
    device = str(transport_spec.options.get("device", "cpu"))
    if (
        cls.__module__ == "rl_weightsync.broadcast"
        and rc.layout == "colocated"
        and device.startswith("cuda")
    ):
        raise ConfigError(
            "weight_transport.device: 'broadcast' on cuda (NCCL) cannot join a policy rank and "
            "the generator that shares its GPU (runtime.layout=colocated): NCCL refuses two "
            "ranks on one device. Use runtime.layout=disaggregated, or weight_transport: "
            "{type: disk_full} or {type: disk_delta} for the colocated layout."
        )


def _check_model_ranks(config: Any) -> None:
    """The policy (and critic) must be able to use the policy ranks, in their layout."""
    rc = config.runtime
    pol = registry.resolve(registry.GROUPS["policy"], config.policy.type, field="policy.type")
    if rc.policy.count > 1 and pol.__module__.startswith("rl_hf"):
        raise ConfigError(
            f"runtime.policy.count: {rc.policy.count} ranks, but policy.type={config.policy.type!r}"
            " trains in one process (no data or tensor parallelism). Use runtime.policy.count=1, "
            "or a parallel policy such as policy.type=megatron."
        )
    if config.critic is not None and rc.policy.count > 1:
        crit = registry.resolve(registry.GROUPS["critic"], config.critic.type, field="critic.type")
        if crit.__module__.startswith("rl_hf"):
            raise ConfigError(
                f"critic.type: {config.critic.type!r} trains in one process, but the critic runs "
                f"on the {rc.policy.count} policy ranks; use a parallel critic such as "
                "critic.type=megatron, or runtime.policy.count=1."
            )
        copts = config.critic.options
        for key in ("tp_size", "pp_size"):
            if int(copts.get(key, 1)) != int(config.policy.options.get(key, 1)):
                raise ConfigError(
                    f"critic.{key}: {copts.get(key, 1)} differs from policy.{key} "
                    f"{config.policy.options.get(key, 1)}; the critic shares the policy ranks "
                    "and their layout, so set the same value."
                )
    opts = config.policy.options
    model_parallel = int(opts.get("tp_size", 1)) * int(opts.get("pp_size", 1))
    if rc.policy.count % model_parallel:
        raise ConfigError(
            f"runtime.policy.count: {rc.policy.count} ranks is not a multiple of policy tp_size "
            f"x pp_size = {model_parallel}; the ranks form (count / that) data-parallel "
            "replicas."
        )


# --------------------------------------------------------------------------------------------
# Actors (plain classes; the runtime wraps them with ray.remote)
# --------------------------------------------------------------------------------------------


def setup_process(threads: int, env: dict[str, str]) -> None:
    """Prepare an actor process: its environment, torch threads and the Hugging Face imports."""
    os.environ.update(env)
    torch.set_num_threads(threads)
    # Import the Hugging Face stack at actor start, not in the first timed call.
    with contextlib.suppress(ImportError):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
