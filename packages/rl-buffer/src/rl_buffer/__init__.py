"""rl-buffer: prompt data sources, the rollout buffer (staleness control, partial rollouts),
group filters and dynamic sampling, and FLOPs-aware data-parallel balancing.

Usable alone (``pip install rlpost-buffer``): it depends only on ``rlpost-core`` and numpy.
"""

from rl_buffer.balance import SchedulePlan, pack_micro_batches, schedule_step, split_steps
from rl_buffer.buffer import GroupBuffer
from rl_buffer.filters import FailedStatusFilter, OverlongFilter, RewardStdFilter, apply_filters
from rl_buffer.flops import estimate_flops, estimate_flops_array
from rl_buffer.partial import continue_rollout, resume_request
from rl_buffer.sampler import DynamicSampler, SamplingExhaustedError
from rl_buffer.sources import (
    FileSource,
    HFDatasetSource,
    JsonlSource,
    MixtureSource,
    ParquetSource,
    SourceConfig,
)
from rl_buffer.step_batches import rank_batches
from rl_buffer.version import __version__

__all__ = [
    "DynamicSampler",
    "FailedStatusFilter",
    "FileSource",
    "GroupBuffer",
    "HFDatasetSource",
    "JsonlSource",
    "MixtureSource",
    "OverlongFilter",
    "ParquetSource",
    "RewardStdFilter",
    "SamplingExhaustedError",
    "SchedulePlan",
    "SourceConfig",
    "__version__",
    "apply_filters",
    "continue_rollout",
    "estimate_flops",
    "estimate_flops_array",
    "pack_micro_batches",
    "rank_batches",
    "resume_request",
    "schedule_step",
    "split_steps",
]
