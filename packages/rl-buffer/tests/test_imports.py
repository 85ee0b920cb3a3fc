"""The public surface is explicit, and importing rl_buffer pulls in no heavy optional library."""

from __future__ import annotations

import subprocess
import sys

import rl_buffer

EXPECTED = {
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
}


def test_all_is_pinned():
    assert set(rl_buffer.__all__) == EXPECTED
    for name in rl_buffer.__all__:
        assert getattr(rl_buffer, name) is not None


def test_no_heavy_imports():
    code = (
        "import sys, rl_buffer, rl_buffer.sources, rl_buffer.balance; "
        "bad = [m for m in ('transformers', 'pyarrow', 'datasets', 'megatron', 'sglang', 'ray')"
        " if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_points_resolve():
    from rl_core import registry

    assert {"jsonl", "parquet", "hf_datasets"} <= set(registry.available("rl.data_sources"))
    assert registry.resolve("rl.buffers", "group") is rl_buffer.GroupBuffer
    f = registry.build("filter", "reward_std")
    assert isinstance(f, rl_buffer.RewardStdFilter)
