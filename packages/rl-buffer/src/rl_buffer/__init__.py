"""rl-buffer: prompt data sources, turning prompts into scored groups (sampling, custom rollout
functions, rewards bounded in time, failures counted), the rollout buffer (staleness control,
partial rollouts), group filters and dynamic sampling, and FLOPs-aware data-parallel balancing.

Usable alone (``pip install rlpost-buffer``): it depends only on ``rlpost-core`` and numpy.
"""

from rl_buffer.balance import SchedulePlan, pack_micro_batches, schedule_step, split_steps
from rl_buffer.buffer import GroupBuffer
from rl_buffer.failures import RolloutStats
from rl_buffer.filters import (
    FailedStatusFilter,
    GuardedFilter,
    OverlongFilter,
    RewardStdFilter,
    apply_filters,
    filter_groups,
)
from rl_buffer.flops import estimate_flops, estimate_flops_array
from rl_buffer.partial import continue_rollout, resume_request
from rl_buffer.rollout import generate_groups
from rl_buffer.sampler import DynamicSampler, SamplingExhaustedError
from rl_buffer.scoring import Scorer
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
    "GuardedFilter",
    "HFDatasetSource",
    "JsonlSource",
    "MixtureSource",
    "OverlongFilter",
    "ParquetSource",
    "RewardStdFilter",
    "RolloutStats",
    "SamplingExhaustedError",
    "SchedulePlan",
    "Scorer",
    "SourceConfig",
    "__version__",
    "apply_filters",
    "continue_rollout",
    "estimate_flops",
    "estimate_flops_array",
    "filter_groups",
    "generate_groups",
    "pack_micro_batches",
    "rank_batches",
    "resume_request",
    "schedule_step",
    "split_steps",
]
