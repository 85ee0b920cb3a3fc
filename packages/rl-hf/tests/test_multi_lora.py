"""Multi-LoRA on the Hugging Face backend (``policy.lora.adapters``): each adapter trains only
on its own sequences, log-probs use each sequence's adapter, checkpoints hold one peft
directory per adapter and resume exactly; HFGenerator serves each request with its adapter."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from rl_core.errors import ConfigError, GenerationError  # noqa: E402
from rl_core.lora import AdapterInfo, LoRAConfig, merge_adapter, peft_adapter_config  # noqa: E402
from rl_core.testing.policy import PolicyConformance, random_batch, sft_loss  # noqa: E402
from rl_core.types import GenerationRequest, SamplingParams  # noqa: E402
from rl_hf import HFGenerator, HFPolicy, TinyModelSpec, build_tiny_model  # noqa: E402

MULTI = LoRAConfig(rank=4, alpha=8.0, adapters=("solver", "critic"))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


def _policy(path: Path, lora: LoRAConfig = MULTI) -> HFPolicy:
    return HFPolicy(HFPolicy.Config(model_path=str(path), lr=1e-2, lora=lora))


def _batch(policy: HFPolicy, adapters: tuple[str | None, ...], seed: int = 3):
    lengths = [7, 5, 9, 6][: len(adapters)]
    batch = random_batch(policy.model_shape.vocab_size, lengths, seed=seed)
    return dataclasses.replace(batch, adapters=adapters)


def _adapter(policy: HFPolicy, name: str) -> dict[str, torch.Tensor]:
    prefix = f"{name}/"
    return {
        n[len(prefix) :]: t.clone()
        for n, t in policy.named_adapter_weights()
        if n.startswith(prefix)
    }


class TestHFPolicyMultiLoRA(PolicyConformance):
    """The Policy contract holds with two adapters (batches without adapters: the default)."""

    supports_offload = True

    @pytest.fixture
    def policy(self, base_dir: Path) -> HFPolicy:
        return _policy(base_dir)


def test_config_refuses_inconsistent_adapters() -> None:
    with pytest.raises(ConfigError, match="policy.lora.adapters"):
        LoRAConfig(adapters=("a", "a"))
    with pytest.raises(ConfigError, match="policy.lora.name"):
        LoRAConfig(adapters=("a", "b"), name="c")
    assert LoRAConfig(adapters=("a", "b")).default_adapter == "a"
    assert LoRAConfig(adapters=("a", "b"), name="b").default_adapter == "b"


def test_each_adapter_trains_only_on_its_own_sequences(base_dir: Path) -> None:
    policy = _policy(base_dir)
    before = {a: _adapter(policy, a) for a in ("solver", "critic")}
    assert all(before[a] for a in before)
    metrics = policy.train_step(_batch(policy, ("solver", "solver", None)), sft_loss)
    after = {a: _adapter(policy, a) for a in ("solver", "critic")}
    # None is the default adapter (solver): the critic adapter is bitwise unchanged
    assert all(torch.equal(before["critic"][k], after["critic"][k]) for k in before["critic"])
    assert any(not torch.equal(before["solver"][k], after["solver"][k]) for k in before["solver"])
    assert metrics["grad_norm/solver"] > 0 and metrics["grad_norm/critic"] == 0
    policy.train_step(_batch(policy, ("critic", "critic")), sft_loss)
    moved = {a: _adapter(policy, a) for a in ("solver", "critic")}
    assert all(torch.equal(after["solver"][k], moved["solver"][k]) for k in after["solver"])
    assert any(not torch.equal(after["critic"][k], moved["critic"][k]) for k in after["critic"])


def test_mixed_batch_logprobs_use_each_sequences_adapter(base_dir: Path) -> None:
    policy = _policy(base_dir)
    policy.train_step(_batch(policy, ("solver", "solver")), sft_loss)
    policy.train_step(_batch(policy, ("critic", "critic"), seed=5), sft_loss)
    mixed = _batch(policy, ("critic", "solver", "critic"), seed=7)
    logp_T = policy.compute_logprobs(mixed).logprobs
    base_T = policy.compute_base_logprobs(mixed).logprobs
    assert not torch.allclose(logp_T, base_T)
    for a in ("solver", "critic"):
        alone = policy.compute_logprobs(dataclasses.replace(mixed, adapters=(a,) * 3)).logprobs
        for i, name in enumerate(mixed.adapters):
            lo, hi = int(mixed.cu_seqlens[i]), int(mixed.cu_seqlens[i + 1])
            if name == a:
                torch.testing.assert_close(logp_T[lo:hi], alone[lo:hi], rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="rollout.adapter_key"):
        policy.compute_logprobs(dataclasses.replace(mixed, adapters=("nope", None, None)))


def test_checkpoint_has_a_peft_directory_per_adapter_and_resumes_exactly(
    base_dir: Path, tmp_path: Path
) -> None:
    policy = _policy(base_dir)
    policy.train_step(_batch(policy, ("solver", "critic", "solver")), sft_loss)
    policy.save(tmp_path / "ckpt")
    for a in ("solver", "critic"):
        loaded = peft.PeftModel.from_pretrained(
            __import__("transformers").AutoModelForCausalLM.from_pretrained(str(base_dir)),
            str(tmp_path / "ckpt" / a),
        )
        assert loaded is not None
    nxt = _batch(policy, ("critic", "solver"), seed=9)
    policy.train_step(nxt, sft_loss)
    want = dict(policy.named_adapter_weights())
    resumed = _policy(base_dir)
    resumed.load(tmp_path / "ckpt")
    resumed.train_step(nxt, sft_loss)
    got = dict(resumed.named_adapter_weights())
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


# ----------------------------------------------------------------------------- generator


def _requests(adapters: list[str | None]) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=tuple(range(3 + i, 9 + 2 * i)),
            sampling=SamplingParams(max_new_tokens=6, temperature=0.0, seed=i),
            adapter=a,
        )
        for i, a in enumerate(adapters)
    ]


def _trained_pair(base_dir: Path) -> HFPolicy:
    policy = HFPolicy(HFPolicy.Config(model_path=str(base_dir), lr=5e-2, lora=MULTI))
    for _ in range(3):
        policy.train_step(_batch(policy, ("solver", "solver")), sft_loss)
        policy.train_step(_batch(policy, ("critic", "critic"), seed=5), sft_loss)
    return policy


def _load_both(gen: HFGenerator, policy: HFPolicy, version: int = 1) -> None:
    info = AdapterInfo("solver", peft_adapter_config(MULTI.single("solver")), names=MULTI.adapters)
    gen.load_adapter(info, policy.named_adapter_weights(), version=version)


def test_generator_serves_each_request_with_its_adapter(base_dir: Path) -> None:
    policy = _trained_pair(base_dir)
    gen = HFGenerator(HFGenerator.Config(model_path=str(base_dir), max_batch_size=8))
    _load_both(gen, policy)
    assert gen.weight_version == 1 and gen.active_adapter == "solver"
    order = ["critic", "solver", None, "critic"]
    mixed = asyncio.run(gen.generate(_requests(order)))
    base = {n: t for n, t in policy._live_state().items() if "/" not in n}
    wants = {}
    for a in ("solver", "critic"):
        merged = merge_adapter(base, _adapter(policy, a), MULTI.single(a))
        ref = HFGenerator(HFGenerator.Config(model_path=str(base_dir), max_batch_size=8))
        ref.load_weights(merged.items(), version=1)
        want = wants[a] = asyncio.run(ref.generate(_requests([None] * len(order))))
        for res, w, name in zip(mixed, want, order, strict=True):
            if (name or "solver") == a:
                assert res.output_ids == w.output_ids, (a, res.request_id)
        asyncio.run(ref.close())
    # the adapters differ, so serving a request with the wrong one would be seen
    assert [r.output_ids for r in wants["solver"]] != [r.output_ids for r in wants["critic"]]
    # the mixed batch equals each adapter's requests generated separately
    for a in ("solver", "critic"):
        idx = [i for i, n in enumerate(order) if (n or "solver") == a]
        alone = asyncio.run(gen.generate([_requests(order)[i] for i in idx]))
        assert [r.output_ids for r in alone] == [mixed[i].output_ids for i in idx]
    with pytest.raises(GenerationError, match="nope"):
        asyncio.run(gen.generate(_requests(["nope"])))
    asyncio.run(gen.close())


def test_generator_refuses_an_incomplete_multi_adapter_update_unchanged(base_dir: Path) -> None:
    from rl_core.errors import WeightSyncError

    policy = _policy(base_dir)
    gen = HFGenerator(HFGenerator.Config(model_path=str(base_dir)))
    info = AdapterInfo("solver", peft_adapter_config(MULTI.single("solver")), names=MULTI.adapters)
    weights = list(policy.named_adapter_weights())
    broken = [(n, t) for n, t in weights if not (n.startswith("critic/") and ".lora_B." in n)]
    with pytest.raises(WeightSyncError, match="critic"):
        gen.load_adapter(info, broken, version=1)
    assert gen.weight_version == 0 and gen.active_adapter is None
    asyncio.run(gen.close())
