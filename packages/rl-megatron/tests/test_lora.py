"""MegatronPolicy with ``policy.lora`` in this process (a world of one, gloo): the same
log-probs, step and adapter tensors as transformers + peft on the same weights and adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.errors import CheckpointError, ConfigError
from rl_core.lora import LoRAConfig, load_adapter
from rl_core.testing.modules import load_module
from rl_core.testing.policy import PolicyConformance, random_batch, sft_loss
from rl_megatron.critic import MegatronCritic
from rl_megatron.policy import MegatronPolicy

LR = 1e-3


R = load_module("_rl_megatron_tests_lora_reference", Path(__file__).with_name("_lora_reference.py"))
ALPHA, RANK, TARGETS = R.ALPHA, R.RANK, R.TARGETS


def _lora_policy(path: Path, adapter: Path | None = None, **kw: object) -> MegatronPolicy:
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=tuple(TARGETS))
    cfg = MegatronPolicy.Config(
        model_path=str(path), lora=lora, lora_init=str(adapter) if adapter else None, **kw
    )  # type: ignore[arg-type]
    return MegatronPolicy(cfg)


class TestMegatronLoRAConformance(PolicyConformance):
    """The standard Policy suite with ``policy.lora`` (a fresh rank-8 adapter on every linear
    layer, world 1): weights are the merged ones, only the adapter trains."""

    @pytest.fixture
    def policy(self, model_dirs: dict[str, Path]) -> MegatronPolicy:
        lora = LoRAConfig(rank=8, alpha=16.0)
        return MegatronPolicy(
            MegatronPolicy.Config(model_path=str(model_dirs["qwen2"]), lr=1e-2, lora=lora)
        )


@pytest.fixture(scope="module")
def adapters(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One random non-zero peft adapter per tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return {arch: R.make_peft_adapter(p, root / arch, seed=7) for arch, p in model_dirs.items()}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_lora_logprobs_base_and_adapter_tensors_match_peft(
    arch: str, model_dirs: dict[str, Path], adapters: dict
) -> None:
    """Log-probs with the adapter equal transformers + peft within 1e-5; with adapters disabled
    they equal the plain base model's; named_adapter_weights is peft's state dict; named_weights
    is peft's merged model."""
    path, adapter = model_dirs[arch], adapters[arch]
    policy = _lora_policy(path, adapter)
    batch = random_batch(
        policy.model_shape.vocab_size, [7, 3, 9], seed=3, micro_batch_bounds=(0, 2, 3)
    )
    ref = R.peft_model(path, adapter)
    with torch.no_grad():
        expected = R.logprobs(ref, batch)
        with ref.disable_adapter():
            expected_base = R.logprobs(ref, batch)
        ref_state = {
            n: t.clone() for n, t in __import__("peft").get_peft_model_state_dict(ref).items()
        }
        merged = {n: t.clone() for n, t in ref.merge_and_unload().state_dict().items()}
    mine = policy.compute_logprobs(batch).logprobs
    base = policy.compute_base_logprobs(batch).logprobs
    assert (expected - expected_base).abs().max() > 1e-2  # the adapter changes the model
    print(
        f"{arch}: max|logp diff| {float((mine - expected).abs().max()):.2e}, "
        f"base {float((base - expected_base).abs().max()):.2e}"
    )
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(base, expected_base, atol=1e-5, rtol=0)
    exported = dict(policy.named_adapter_weights())
    assert list(exported) == list(ref_state)
    for name, tensor in ref_state.items():
        assert torch.equal(exported[name], tensor), name
    for name, tensor in policy.named_weights():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)


def test_lora_train_step_matches_peft_adamw(model_dirs: dict[str, Path], adapters: dict) -> None:
    """One step on the adapter only: loss, grad norm and the adapter after the step equal a
    peft + torch AdamW step on the same batch; the base weights do not move and the optimizer
    holds adapter state only."""
    path, adapter = model_dirs["llama"], adapters["llama"]
    policy = _lora_policy(path, adapter, lr=LR, grad_clip=1.0)
    base_before = {n: t.clone() for n, t in policy._weights.params.items()}
    batch = random_batch(
        policy.model_shape.vocab_size, [6, 9, 4, 8], seed=4, micro_batch_bounds=(0, 1, 4)
    )
    m = policy.train_step(batch, sft_loss)
    ref = R.reference_step(path, adapter, batch, lr=LR)
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    mine = dict(policy.named_adapter_weights())
    diff = max(float((mine[n] - ref["after"][n]).abs().max()) for n in ref["after"])
    update = max(float((ref["after"][n] - ref["before"][n]).abs().max()) for n in ref["after"])
    print(f"step: max|adapter diff| {diff:.2e} (max update {update:.2e})")
    assert update > 1e-4 and diff <= 1e-5
    for name, tensor in policy._weights.params.items():
        assert torch.equal(tensor, base_before[name]), name
    n_adapter = sum(1 for _ in policy.named_adapter_weights())
    states = [
        s for opt in policy.optimizer.chained_optimizers for s in opt.optimizer.state.values()
    ]
    assert len(states) == n_adapter  # Adam state for each A and B, none for the base
    assert sum(p.requires_grad for p in policy.module.parameters()) == n_adapter


def test_lora_refuses_bad_settings(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Unknown targets, lora_init without lora, a LoRA critic, a mismatched adapter and a
    mixture-of-experts model are named errors."""
    path = model_dirs["qwen2"]
    with pytest.raises(ConfigError, match="target_modules"):
        MegatronPolicy(
            MegatronPolicy.Config(
                model_path=str(path), lora=LoRAConfig(target_modules=("lm_head",))
            )
        )
    with pytest.raises(ConfigError, match="lora_init"):
        MegatronPolicy.Config(model_path=str(path), lora_init="x")
    with pytest.raises(ConfigError, match="critic.lora"):
        MegatronCritic.Config(model_path=str(path), lora=LoRAConfig())
    adapter = R.make_peft_adapter(path, tmp_path / "qv", targets=["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="rank/scaling/targets"):
        _lora_policy(path, adapter)
    moe = load_module(
        "_rl_megatron_tests_moe_reference", Path(__file__).with_name("_moe_reference.py")
    )
    moe_dir = moe.build_qwen3_moe_model(tmp_path / "moe")
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        MegatronPolicy(MegatronPolicy.Config(model_path=str(moe_dir), lora=LoRAConfig()))


def test_lora_subset_of_targets_matches_peft(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Adapters on q_proj and v_proj only (k's block of the fused qkv stays zero) and on
    up_proj only (gate's half of fc1 stays zero): log-probs as peft's."""
    path = model_dirs["qwen3"]
    for targets in (["q_proj", "v_proj"], ["up_proj", "o_proj"]):
        adapter = R.make_peft_adapter(path, tmp_path / "_".join(targets), targets=targets)
        lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=tuple(targets))
        policy = MegatronPolicy(
            MegatronPolicy.Config(model_path=str(path), lora=lora, lora_init=str(adapter))
        )
        batch = random_batch(policy.model_shape.vocab_size, [7, 5], seed=5)
        with torch.no_grad():
            expected = R.logprobs(R.peft_model(path, adapter), batch)
        got = policy.compute_logprobs(batch).logprobs
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert sum(1 for _ in policy.named_adapter_weights()) == 2 * len(targets) * 2


def test_lora_checkpoint_holds_adapter_and_resumes_exactly(
    model_dirs: dict[str, Path], adapters: dict, tmp_path: Path
) -> None:
    """save() writes the peft adapter (no base weights; peft loads it) + optimizer state; a new
    policy loading it takes the next step exactly as the uninterrupted one; another base model
    and a policy without lora are refused."""
    path = model_dirs["qwen2"]
    a = _lora_policy(path, adapters["qwen2"], lr=LR)
    vocab = a.model_shape.vocab_size
    batches = [random_batch(vocab, [5, 7], seed=s, micro_batch_bounds=(0, 1, 2)) for s in (1, 2)]
    a.train_step(batches[0], sft_loss)
    a.save(tmp_path / "ckpt")
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "model.safetensors" not in saved and "adapter_model.safetensors" in saved
    with torch.no_grad():  # the saved adapter is a peft adapter of the trained model
        expected = R.logprobs(R.peft_model(path, tmp_path / "ckpt"), batches[1])
    torch.testing.assert_close(a.compute_logprobs(batches[1]).logprobs, expected, atol=1e-5, rtol=0)
    a.train_step(batches[1], sft_loss)
    b = _lora_policy(path, lr=LR)
    b.load(tmp_path / "ckpt")
    assert b.version == 1
    b.train_step(batches[1], sft_loss)
    mine, theirs = dict(b.named_adapter_weights()), dict(a.named_adapter_weights())
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    with pytest.raises(CheckpointError, match="base model"):
        _lora_policy(model_dirs["llama"], lr=LR).load(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="policy.lora"):
        MegatronPolicy(MegatronPolicy.Config(model_path=str(path))).load(tmp_path / "ckpt")


def test_save_merged_is_a_plain_model_with_the_adapter_folded_in(
    model_dirs: dict[str, Path], adapters: dict, tmp_path: Path
) -> None:
    """save_merged() (the trainer's final_model of a LoRA run) writes a Hugging Face directory
    a policy without lora loads to the same log-probs as the adapted one."""
    path = model_dirs["qwen2"]
    a = _lora_policy(path, adapters["qwen2"], lr=LR)
    batch = random_batch(a.model_shape.vocab_size, [6, 4], seed=3, micro_batch_bounds=(0, 1, 2))
    a.train_step(batch, sft_loss)
    a.save_merged(tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert not (tmp_path / "merged" / "adapter_model.safetensors").exists()
    plain = MegatronPolicy(MegatronPolicy.Config(model_path=str(tmp_path / "merged")))
    torch.testing.assert_close(
        plain.compute_logprobs(batch).logprobs,
        a.compute_logprobs(batch).logprobs,
        atol=1e-5,
        rtol=0,
    )


def test_multi_lora_is_refused_by_name() -> None:
    """Several adapters (``policy.lora.adapters``) run on HFPolicy only."""
    with pytest.raises(ConfigError, match=r"policy.lora.adapters: .*policy.type: hf"):
        MegatronPolicy.Config(model_path="unused", lora=LoRAConfig(adapters=("a", "b")))


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_lora_on_cuda_matches_peft(
    model_dirs: dict[str, Path], adapters: dict, dtype: str, atol: float
) -> None:
    """GPU only: Megatron LoRA on CUDA (fp32 and bf16 parameters) gives transformers + peft's
    log-probs (fp32 on CPU), and a step moves the adapter only (base log-probs unchanged)."""
    path = model_dirs["qwen2"]
    policy = _lora_policy(path, adapters["qwen2"], lr=LR, dtype=dtype)
    batch = random_batch(policy.model_shape.vocab_size, [9, 5], seed=5)
    with torch.no_grad():
        expected = R.logprobs(R.peft_model(path, adapters["qwen2"]), batch)
    got = policy.compute_logprobs(batch).logprobs.float().cpu()
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    base = policy.compute_base_logprobs(batch).logprobs.float().cpu()
    policy.train_step(batch, sft_loss)
    assert torch.equal(policy.compute_base_logprobs(batch).logprobs.float().cpu(), base)
    assert not torch.equal(policy.compute_logprobs(batch).logprobs.float().cpu(), got)


def test_full_policy_refuses_adapter_calls_by_name(
    model_dirs: dict[str, Path], adapters: dict
) -> None:
    """Without ``policy.lora`` every adapter call is a ConfigError naming ``policy.lora`` (and
    changes nothing); ``adapters_disabled`` is a no-op."""
    policy = MegatronPolicy(MegatronPolicy.Config(model_path=str(model_dirs["qwen2"])))
    before = {n: t.clone() for n, t in policy.named_weights()}
    tensors, _ = load_adapter(adapters["qwen2"])
    with pytest.raises(ConfigError, match="policy.lora"):
        policy.load_adapter_weights(tensors.items())
    with pytest.raises(ConfigError, match="policy.lora"):
        policy.load_adapter(str(adapters["qwen2"]))
    with pytest.raises(ConfigError, match="policy.lora"):
        list(policy.named_adapter_weights())
    with policy.adapters_disabled():
        pass
    after = dict(policy.named_weights())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
