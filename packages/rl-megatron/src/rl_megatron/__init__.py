"""rl-megatron: a :class:`~rl_core.interfaces.Policy` on megatron-core.

``MegatronPolicy`` (registry name ``megatron``; ``MegatronCritic`` is its value-model twin) trains Llama / Qwen2 / Qwen3 models built from a
Hugging Face ``config.json`` with tensor and data parallelism; :mod:`rl_megatron.convert` maps
weights between Hugging Face and Megatron layouts. Importing this package does not import
megatron-core; building a policy does.
"""

from rl_megatron.version import __version__

__all__ = ["MegatronCritic", "MegatronPolicy", "__version__"]


def __getattr__(name: str) -> object:
    if name == "MegatronPolicy":
        from rl_megatron.policy import MegatronPolicy

        return MegatronPolicy
    if name == "MegatronCritic":
        from rl_megatron.critic import MegatronCritic

        return MegatronCritic
    raise AttributeError(f"module 'rl_megatron' has no attribute {name!r}")
