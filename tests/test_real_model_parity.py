"""Parity on real weights: SmolLM2-135M-Instruct (Llama, 49k vocabulary) through every backend.

Each generator samples a few short chat completions; every policy scores the same tokens. The
reference is HFPolicy in float32. The tolerances are the ones each pair achieves, measured on
this model (max |difference| of per-token log-probs over the sampled response tokens; the
measured value is in the comment next to each bound, the bound leaves ~2-4x headroom).
MegatronPolicy runs at TP=1 here and at TP=3 in one three-process launch (SmolLM2 has 9 query
and 3 key/value heads, so TP=2 cannot split it; TP=3 is the smallest tensor-parallel layout it
takes). Megatron in bfloat16 needs CUDA: ``test_megatron_bf16_logprobs_gpu``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_core.algorithms import PolicyLoss, importance_weights
from rl_core.types import GenerationRequest, SamplingParams, TrainBatch
from rl_hf import HFGenerator, HFPolicy
from rl_hf.convert import smollm2_135m_instruct

PROMPTS = ["What is 7 plus 5?", "Name a color."]
SAMPLES = 2
NEW_TOKENS = 12
TP_WORKER = Path(__file__).with_name("_real_model_tp_worker.py")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_135m_instruct()


def chat_prompts(tokenizer) -> list[list[int]]:
    """The prompts rendered with the model's own chat template (system prompt included)."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in PROMPTS
    ]


def sample(generator, prompts: list[list[int]]) -> list[tuple[list[int], list[int], list[float]]]:
    """``SAMPLES`` completions of each prompt at temperature 1: (prompt, response, engine
    log-probs of the response)."""
    requests = [
        GenerationRequest(
            request_id=f"p{i}s{j}",
            input_ids=tuple(p),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=100 * i + j),
        )
        for i, p in enumerate(prompts)
        for j in range(SAMPLES)
    ]
    results = asyncio.run(generator.generate(requests))
    out = []
    for req, res in zip(requests, results):
        out.append((list(req.input_ids), list(res.output_ids), list(res.output_logprobs)))
    return out


def batch_of(samples) -> TrainBatch:
    """The samples packed as one TrainBatch: loss mask on the response tokens, the engine's
    log-probs as ``rollout_logprobs``, per-token mean weights."""
    tokens, mask, roll, cu = [], [], [], [0]
    for prompt, response, logprobs in samples:
        tokens += prompt + response
        mask += [0.0] * len(prompt) + [1.0] * len(response)
        roll += [0.0] * len(prompt) + logprobs
        cu.append(len(tokens))
    mask_T = torch.tensor(mask)
    return TrainBatch(
        tokens=torch.tensor(tokens),
        cu_seqlens=torch.tensor(cu),
        loss_mask=mask_T,
        loss_weights=mask_T / mask_T.sum(),
        advantages=mask_T.clone(),
        rollout_logprobs=torch.tensor(roll),
        micro_batch_bounds=(0, 2, len(samples)),
    )


def max_diff(a_T: torch.Tensor, b_T: torch.Tensor, batch: TrainBatch) -> float:
    """Largest |a - b| over the response tokens."""
    on = batch.loss_mask > 0
    return float((a_T.float()[on] - b_T.float()[on]).abs().max())


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> HFPolicy:
    return HFPolicy(HFPolicy.Config(model_path=str(smollm2)))


@pytest.fixture(scope="module")
def hf_fp32_batch(smollm2: Path, reference: HFPolicy) -> TrainBatch:
    gen = HFGenerator(HFGenerator.Config(model_path=str(smollm2), seed=1))
    return batch_of(sample(gen, chat_prompts(reference.tokenizer)))


@pytest.fixture(scope="module")
def hf_bf16_batch(smollm2: Path, reference: HFPolicy) -> TrainBatch:
    gen = HFGenerator(HFGenerator.Config(model_path=str(smollm2), dtype="bfloat16", seed=1))
    return batch_of(sample(gen, chat_prompts(reference.tokenizer)))


def test_hf_generator_and_policy_logprobs_agree_in_fp32_and_bf16(
    smollm2: Path, reference: HFPolicy, hf_fp32_batch: TrainBatch, hf_bf16_batch: TrainBatch
) -> None:
    batch = hf_fp32_batch
    assert int(batch.loss_mask.sum()) >= 2 * len(PROMPTS)
    ref_T = reference.compute_logprobs(batch).logprobs
    gen_fp32 = max_diff(batch.rollout_logprobs, ref_T, batch)
    bf16 = HFPolicy(HFPolicy.Config(model_path=str(smollm2), dtype="bfloat16"))
    pol_bf16 = max_diff(bf16.compute_logprobs(batch).logprobs, ref_T, batch)
    del bf16
    b16 = hf_bf16_batch
    gen_bf16 = max_diff(b16.rollout_logprobs, reference.compute_logprobs(b16).logprobs, b16)
    print(
        f"\nHF fp32 gen vs policy {gen_fp32:.2e}; HF bf16 policy {pol_bf16:.2e}; "
        f"HF bf16 gen {gen_bf16:.2e}"
    )
    assert gen_fp32 <= 1.5e-4  # measured 3.7e-5 (KV-cache decode vs one packed forward)
    assert pol_bf16 <= 0.4  # measured 0.127 (bf16 weights and activations, fp32 log-softmax)
    assert gen_bf16 <= 0.6  # measured 0.195 (bf16 engine's own samples vs the fp32 trainer)


def test_megatron_tp1_logprobs_and_conversion_exact_both_ways(
    smollm2: Path, reference: HFPolicy, hf_fp32_batch: TrainBatch, tmp_path: Path
) -> None:
    from rl_megatron.policy import MegatronPolicy

    policy = MegatronPolicy(MegatronPolicy.Config(model_path=str(smollm2)))
    original = load_file(str(smollm2 / "model.safetensors"))
    exported = dict(policy.named_weights())
    assert set(exported) == set(original) - {"lm_head.weight"}  # tied
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    batch = hf_fp32_batch
    mine = policy.compute_logprobs(batch, with_entropy=True)
    theirs = reference.compute_logprobs(batch, with_entropy=True)
    lp, ent = (
        max_diff(mine.logprobs, theirs.logprobs, batch),
        max_diff(mine.entropy, theirs.entropy, batch),
    )
    print(f"\nMegatron TP=1 fp32 vs HF: logprobs {lp:.2e}, entropy {ent:.2e}")
    assert lp <= 1e-4  # measured 1.4e-5
    # measured 3.8e-3: HFPolicy's entropy, not Megatron's (see the xfail test below)
    assert ent <= 1.5e-2
    # Megatron -> HF: the exported tensors, loaded by a fresh HFPolicy, give the same weights.
    hf = HFPolicy(HFPolicy.Config(model_path=str(smollm2)))
    noisy = {n: t + 0.01 for n, t in exported.items()}
    policy.load_weights(list(noisy.items()), version=1)
    hf.load_weights(list(policy.named_weights()), version=1)
    back = dict(hf.named_weights())
    for name, tensor in noisy.items():
        assert torch.equal(back[name], tensor), name


def test_megatron_tp3_logprobs_and_export_exact(
    smollm2: Path, reference: HFPolicy, hf_fp32_batch: TrainBatch, tmp_path: Path
) -> None:
    batch_pt, out_pt = tmp_path / "batch.pt", tmp_path / "out.pt"
    torch.save(hf_fp32_batch, batch_pt)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", "0", "--rdzv-backend", "c10d"]
    cmd += [str(TP_WORKER), str(smollm2), str(batch_pt), str(out_pt)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = torch.load(out_pt, weights_only=False)
    original = load_file(str(smollm2 / "model.safetensors"))
    assert set(res["exported"]) == set(original) - {"lm_head.weight"}
    for name, tensor in res["exported"].items():
        assert torch.equal(tensor, original[name]), name
    assert res["ranks_equal"]
    theirs = reference.compute_logprobs(hf_fp32_batch, with_entropy=True)
    lp = max_diff(res["logprobs"], theirs.logprobs, hf_fp32_batch)
    ent = max_diff(res["entropy"], theirs.entropy, hf_fp32_batch)
    print(f"\nMegatron TP=3 fp32 vs HF: logprobs {lp:.2e}, entropy {ent:.2e}")
    assert lp <= 1e-4  # measured 1.8e-5
    assert ent <= 1.5e-2  # measured 3.8e-3 (HFPolicy's entropy error, as at TP=1)


@pytest.mark.parametrize("engine", ["fp32", "bf16"])
def test_tis_mis_mismatch_metrics_on_real_weights(
    engine: str, reference: HFPolicy, hf_fp32_batch: TrainBatch, hf_bf16_batch: TrainBatch
) -> None:
    """The trainer (HFPolicy fp32) against the engine's own log-probs (HFGenerator fp32 or bf16):
    PolicyLoss reports the mismatch and the TIS/MIS weights the correction applies."""
    batch = hf_fp32_batch if engine == "fp32" else hf_bf16_batch
    old_T = reference.compute_logprobs(batch).logprobs
    batch = dataclasses.replace(batch, old_logprobs=old_T)
    on = batch.loss_mask > 0
    metrics = {}
    for mode, low, high in (("tis", 0.5, 2.0), ("mis", 0.9, 1.1)):
        loss = PolicyLoss(
            PolicyLoss.Config(correction=mode, correction_clip_low=low, correction_clip_high=high)
        )
        out = loss(old_T.clone().requires_grad_(True), batch)
        metrics[mode] = out.metrics
        w = importance_weights(
            old_T, batch.rollout_logprobs, batch.loss_mask, mode=mode, clip_low=low, clip_high=high
        )
        assert out.metrics["tis_clipfrac"] == pytest.approx(float(w.clipped_T[on].mean()), abs=1e-6)
        assert out.metrics["tis_weight_mean"] == pytest.approx(
            float(w.weights_T[on].mean()), abs=1e-6
        )
    mismatch = float((old_T - batch.rollout_logprobs)[on].abs().mean())
    assert metrics["tis"]["mismatch"] == pytest.approx(mismatch, rel=1e-5)
    print(f"\n{engine} engine: {metrics}")
    if engine == "fp32":
        assert mismatch <= 2e-5  # measured 1.8e-5 (mean |logp_old - logp_rollout|)
        for m in metrics.values():
            assert m["tis_clipfrac"] == 0.0
            assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    else:
        assert 1e-2 <= mismatch <= 0.12  # measured 0.040
        assert metrics["tis"]["tis_clipfrac"] == 0.0  # max |log-ratio| 0.195 < log 2
        assert metrics["tis"]["tis_weight_mean"] == pytest.approx(1.0, abs=0.05)  # 1.016
        assert metrics["mis"]["tis_clipfrac"] > 0.0  # some tokens beyond +-log 1.1 are masked


@pytest.mark.xfail(
    strict=True,
    reason="HFPolicy's entropy lse - sum(p*z) over unshifted real-model logits (|z| up to ~40) "
    "loses ~4e-3 in float32; Megatron's shifted form is within ~4e-7 of float64",
)
def test_hf_policy_entropy_matches_float64_on_real_logits(
    reference: HFPolicy, hf_fp32_batch: TrainBatch
) -> None:
    batch = hf_fp32_batch
    got = reference.compute_logprobs(batch, with_entropy=True).entropy
    tokens_T = batch.tokens
    expected = torch.zeros_like(got, dtype=torch.float64)
    with torch.no_grad():
        for a, b in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
            z_SV = reference.model(tokens_T[None, a:b]).logits[0, :-1].double()
            logp_SV = torch.log_softmax(z_SV, dim=-1)
            expected[a + 1 : b] = -(logp_SV.exp() * logp_SV).sum(-1)
    assert max_diff(got, expected, batch) <= 1e-4


@pytest.fixture(scope="module")
def sglang_python(untimed) -> str:
    """SGLang's own venv (scripts/setup_sglang_env.sh; ~1 s when cached, as in make test; the
    first install runs outside the per-test timeout)."""
    from rl_sglang import _cpu_support

    script = _cpu_support.setup_script()
    with untimed():
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return str(_cpu_support.default_python())


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(
                not os.environ.get("RL_FULL_PARITY"),
                reason="a second SGLang server costs 1-5 min; RL_FULL_PARITY=1 runs it "
                "(measured 0.219 max |diff|)",
            ),
        ),
    ],
)
def test_sglang_cpu_engine_logprobs_match_the_trainer(
    dtype: str,
    smollm2: Path,
    reference: HFPolicy,
    sglang_python: str,
    tmp_path: Path,
    sglang_forked_start,
) -> None:
    """SGLang (CPU engine) samples; its log-probs of its own tokens against HFPolicy fp32, and
    MegatronPolicy fp32 at TP=1 on the same tokens. (The server's scheduler is forked from its
    launcher: root conftest's ``sglang_forked_start``.)"""
    from rl_sglang import SGLangGenerator

    with sglang_forked_start():
        gen = SGLangGenerator(
            SGLangGenerator.Config(
                model_path=str(smollm2),
                python=sglang_python,
                log_dir=str(tmp_path / "logs"),
                server_args={"log_level": "warning", "dtype": dtype},
                seed=1,
            )
        )
    try:
        batch = batch_of(sample(gen, chat_prompts(reference.tokenizer)))
    finally:
        asyncio.run(gen.close())
    assert int(batch.loss_mask.sum()) >= 2 * len(PROMPTS)
    diff = max_diff(batch.rollout_logprobs, reference.compute_logprobs(batch).logprobs, batch)
    print(f"\nSGLang {dtype} engine vs HFPolicy fp32: {diff:.2e}")
    if dtype == "float32":
        assert diff <= 1.5e-4  # measured 3.5e-5
    else:
        assert diff <= 0.6  # measured 0.219
