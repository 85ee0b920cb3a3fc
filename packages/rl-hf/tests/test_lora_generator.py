"""HFGenerator serving LoRA adapters from adapter-only weight updates (peft in place)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from rl_core.errors import WeightSyncError
from rl_core.lora import LoRAConfig, adapter_of, with_adapter
from rl_core.testing.policy import random_batch, sft_loss
from rl_core.types import GenerationRequest, SamplingParams
from rl_hf import HFGenerator, HFPolicy, build_tiny_model
from rl_weightsync import InProcessTransport


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base"))


def _trained(base_dir: Path, lora: LoRAConfig, seed: int) -> HFPolicy:
    policy = HFPolicy(HFPolicy.Config(model_path=str(base_dir), lr=5e-2, lora=lora, seed=seed))
    batch = random_batch(policy.model_shape.vocab_size, [9, 6, 11], seed=seed)
    for _ in range(3):
        policy.train_step(batch, sft_loss)
    return policy


def _requests(temperature: float = 0.0) -> list[GenerationRequest]:
    prompts = [(1, 2, 3, 4), (5, 6, 7), (8, 9, 10, 11, 12)]
    return [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=p,
            sampling=SamplingParams(max_new_tokens=8, temperature=temperature, seed=i),
        )
        for i, p in enumerate(prompts)
    ]


def _gen(base_dir: Path) -> HFGenerator:
    return HFGenerator(HFGenerator.Config(model_path=str(base_dir), stop_on_eos=False))


async def _push(gen: HFGenerator, policy: HFPolicy, version: int, adapter: bool) -> None:
    transport = InProcessTransport(InProcessTransport.Config())
    if adapter:
        update = transport.publish(version, policy.named_adapter_weights())
        update = with_adapter(update, policy.lora, policy.config.model_path)
        assert adapter_of(update) is not None
    else:
        update = transport.publish(version, policy.named_weights())
    await gen.update_weights(update, transport)
    assert gen.weight_version == version


def test_adapter_update_generates_as_the_merged_weights(base_dir: Path) -> None:
    policy = _trained(base_dir, LoRAConfig(rank=4, alpha=8.0), seed=0)

    async def main():
        with_lora, merged, base = _gen(base_dir), _gen(base_dir), _gen(base_dir)
        await _push(with_lora, policy, 3, adapter=True)
        await _push(merged, policy, 3, adapter=False)
        assert with_lora.active_adapter == "default" and merged.active_adapter is None
        out = []
        for gen in (with_lora, merged, base):
            out.append(await gen.generate(_requests()))
            out.append(await gen.generate(_requests(temperature=1.0)))
            await gen.close()
        return out

    lora_g, lora_s, merged_g, merged_s, base_g, base_s = asyncio.run(main())
    for a, b in ((lora_g, merged_g), (lora_s, merged_s)):
        for ra, rb in zip(a, b, strict=True):
            assert ra.output_ids == rb.output_ids
            torch.testing.assert_close(
                torch.tensor(ra.output_logprobs),
                torch.tensor(rb.output_logprobs),
                atol=1e-5,
                rtol=0,
            )
    assert [r.output_ids for r in lora_s] != [r.output_ids for r in base_s] or any(
        abs(x - y) > 1e-3
        for ra, rb in zip(lora_g, base_g, strict=True)
        for x, y in zip(ra.output_logprobs, rb.output_logprobs, strict=False)
    ), "the adapter did not change generation"


def test_several_named_adapters_the_latest_generates(base_dir: Path) -> None:
    first = _trained(base_dir, LoRAConfig(rank=4, alpha=8.0, name="math"), seed=1)
    second = _trained(
        base_dir, LoRAConfig(rank=2, alpha=4.0, name="code", target_modules=("q_proj",)), seed=2
    )

    async def main():
        gen, ref = _gen(base_dir), _gen(base_dir)
        await _push(gen, first, 1, adapter=True)
        await _push(gen, second, 2, adapter=True)
        assert gen.active_adapter == "code"
        await _push(ref, second, 2, adapter=False)
        latest, expected = await gen.generate(_requests()), await ref.generate(_requests())
        gen._adapters.activate("math")  # switching back serves the first adapter
        await _push(ref, first, 3, adapter=False)
        ref_first = _gen(base_dir)
        await _push(ref_first, first, 1, adapter=False)
        math_out, math_ref = await gen.generate(_requests()), await ref_first.generate(_requests())
        for g in (gen, ref, ref_first):
            await g.close()
        return latest, expected, math_out, math_ref

    latest, expected, math_out, math_ref = asyncio.run(main())
    for got, want in ((latest, expected), (math_out, math_ref)):
        for ra, rb in zip(got, want, strict=True):
            assert ra.output_ids == rb.output_ids
            torch.testing.assert_close(
                torch.tensor(ra.output_logprobs),
                torch.tensor(rb.output_logprobs),
                atol=1e-5,
                rtol=0,
            )


def test_adapter_that_does_not_fit_is_refused_unchanged(base_dir: Path) -> None:
    policy = _trained(base_dir, LoRAConfig(rank=4, alpha=8.0), seed=0)
    adapter = dict(policy.named_adapter_weights())
    gen = _gen(base_dir)
    info = adapter_of(
        with_adapter(InProcessTransport(InProcessTransport.Config()).publish(1, []), policy.lora)
    )
    assert info is not None
    bad_shape = {n: (t[:2] if n.endswith("lora_A.weight") else t) for n, t in adapter.items()}
    with pytest.raises(WeightSyncError, match="shape"):
        gen.load_adapter(info, bad_shape.items(), version=1)
    partial = dict(list(adapter.items())[:-1])
    with pytest.raises(WeightSyncError, match="lacks"):
        gen.load_adapter(info, partial.items(), version=1)
    with pytest.raises(WeightSyncError, match="not named"):
        gen.load_adapter(
            info, [("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))], version=1
        )
    assert gen.active_adapter is None and gen.weight_version == 0
    gen.load_adapter(info, adapter.items(), version=1)
    other = adapter_of(
        with_adapter(
            InProcessTransport(InProcessTransport.Config()).publish(2, []), LoRAConfig(rank=2)
        )
    )
    with pytest.raises(WeightSyncError, match="new name"):
        gen.load_adapter(other, adapter.items(), version=2)
    asyncio.run(gen.close())
