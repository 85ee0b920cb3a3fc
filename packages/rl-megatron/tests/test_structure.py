"""How ``MegatronPolicy`` is built (issue 35): by composition, not from private mixins.

Its concerns (pipeline schedule, HF weight exchange, routing replay, LoRA, checkpoints) are parts
it owns; its bases are the public rl-core contracts only.
"""

from __future__ import annotations

from rl_core.interfaces import Critic, Policy
from rl_core.offload import Offloadable
from rl_megatron.critic import MegatronCritic
from rl_megatron.policy import MegatronPolicy


def test_policy_and_critic_have_only_public_rl_core_bases() -> None:
    """Every class in the MRO of MegatronPolicy and MegatronCritic other than themselves is a
    public rl-core class (a private mixin of rl_megatron sharing the policy's state fails)."""
    assert MegatronPolicy.__mro__ == (MegatronPolicy, Offloadable, Policy, *Policy.__mro__[1:])
    for cls in MegatronCritic.__mro__:
        if cls in (MegatronCritic, MegatronPolicy, object) or cls.__module__ == "abc":
            continue
        assert cls.__module__.startswith("rl_core."), cls
        assert not cls.__name__.startswith("_"), cls
    assert issubclass(MegatronCritic, Critic)
