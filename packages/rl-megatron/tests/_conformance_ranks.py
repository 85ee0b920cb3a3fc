"""The Policy conformance suite at TP=2, PP=2 and DP=2, run by *each* of two ranks (not collected
directly: ``test_conformance_distributed.py`` starts ``pytest`` on this file in two processes
with a torchrun-style environment, so both ranks run the same tests in the same order and every
collective call meets its peer).

The suite's hooks (see :mod:`rl_core.testing.policy`) carry MegatronPolicy's contract: ranks of
a tensor-parallel group and of a pipeline share their batch; each data-parallel rank trains on
its own shard (``TrainBatch.shard(layout.dp_rank)``, loss weights over the whole batch, losses
summed over data-parallel ranks); with pipeline parallelism the loss function runs on the last
stage only. No standard test is overridden.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rl_core.testing.policy import PolicyConformance
from rl_core.types import TrainBatch
from rl_megatron.policy import MegatronPolicy


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest) -> Path:
    """A directory shared by both ranks (checkpoints are written by one rank, read by all)."""
    path = Path(os.environ["RL_MEGATRON_SHARED_TMP"]) / request.node.name
    path.mkdir(parents=True, exist_ok=True)
    return path


class _MegatronHooks:
    """MegatronPolicy's answers to the suite's hooks (a mixin: the no-override guard still
    compares every test against :class:`PolicyConformance` itself)."""

    def train_shards(self, policy: MegatronPolicy) -> int:
        """One shard per data-parallel rank."""
        return policy.layout.dp_size

    def local_train_batch(self, policy: MegatronPolicy, batch: TrainBatch) -> TrainBatch:
        """This rank's data-parallel shard."""
        return batch.shard(policy.layout.dp_rank)

    def runs_loss_fn(self, policy: MegatronPolicy) -> bool:
        """The loss function runs on the last pipeline stage."""
        return policy.layout.pp_rank == policy.layout.pp_size - 1


class TestConformanceTP2(_MegatronHooks, PolicyConformance):
    """Tensor parallel over both ranks (Qwen2, tied embeddings)."""

    @pytest.fixture
    def policy(self, model_dirs: dict[str, Path]) -> MegatronPolicy:
        return MegatronPolicy(
            MegatronPolicy.Config(model_path=str(model_dirs["qwen2"]), lr=1e-2, tp_size=2)
        )


class TestConformancePP2(_MegatronHooks, PolicyConformance):
    """Pipeline parallel over both ranks, one layer per stage (Qwen3, QK-norm, untied)."""

    @pytest.fixture
    def policy(self, model_dirs: dict[str, Path]) -> MegatronPolicy:
        return MegatronPolicy(
            MegatronPolicy.Config(model_path=str(model_dirs["qwen3"]), lr=1e-2, pp_size=2)
        )


class TestConformanceDP2(_MegatronHooks, PolicyConformance):
    """Data parallel over both ranks with the distributed optimizer (Llama, untied)."""

    @pytest.fixture
    def policy(self, model_dirs: dict[str, Path]) -> MegatronPolicy:
        return MegatronPolicy(
            MegatronPolicy.Config(
                model_path=str(model_dirs["llama"]), lr=1e-2, use_distributed_optimizer=True
            )
        )
