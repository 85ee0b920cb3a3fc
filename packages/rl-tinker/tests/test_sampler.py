"""Sampling clients served by rl-hf's HFGenerator (``sampler: hf``), through the official SDK."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
types = tinker.types

TEXT = "the quick brown fox jumps over the lazy dog"


def _train(tc, tok, steps, lr=1e-2):
    ids = tok.encode(TEXT)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()


def _forward_logprobs(tc, prompt, tokens):
    """The training client's log-probs of ``tokens`` after ``prompt`` (a forward pass)."""
    full = [*prompt, *tokens]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:]},
    )
    out = tc.forward([datum], "cross_entropy").result()
    lps = np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float32)
    return lps[len(prompt) - 1 :]


def test_pinned_sampler_is_served_by_the_generator_and_matches_the_policy(serve):
    """A sampler snapshot is a named adapter of the HFGenerator, whose model holds the very base
    tensors of the training model (no second copy). Its sampled tokens' log-probs equal the
    training client's forward at that version and the sampler's compute_logprobs; after more
    training the pinned sampler samples the same tokens with the same log-probs, bitwise."""
    svc = serve()
    sc = tinker.ServiceClient(base_url=svc.url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    tok = tc.get_tokenizer()
    _train(tc, tok, 2)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tok.encode("the quick")
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()

    base = svc.service._bases["tiny"]
    assert base.generator is not None and len(base.generator.loaded) == 1
    gen_model = base.generator.generator.model
    ptrs = {p.data_ptr() for p in base.model.parameters()}
    gen_base = [p for n, p in gen_model.named_parameters() if ".lora_" not in n]
    assert gen_base and all(p.data_ptr() in ptrs for p in gen_base)

    for seq in res.sequences:
        assert len(seq.tokens) >= 1
        fwd = _forward_logprobs(tc, prompt, seq.tokens)
        np.testing.assert_allclose(seq.logprobs, fwd, rtol=0, atol=1e-4)
        full = types.ModelInput.from_ints([*prompt, *seq.tokens])
        clp = sampler.compute_logprobs(full).result()
        np.testing.assert_allclose(seq.logprobs, clp[len(prompt) :], rtol=0, atol=1e-4)

    _train(tc, tok, 3, lr=0.5)
    again = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    for a, b in zip(again.sequences, res.sequences, strict=True):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
    moved = _forward_logprobs(tc, prompt, res.sequences[0].tokens)
    assert np.abs(moved - np.asarray(res.sequences[0].logprobs)).max() > 1e-3


def test_an_evicted_snapshot_reloads_into_a_reused_slot_and_stays_pinned(serve):
    """With one slot per LoRA shape two snapshots take turns in the same generator adapter;
    each keeps sampling its own version (same seed: same tokens and log-probs as before)."""
    svc = serve(max_sampler_slots=1)
    sc = tinker.ServiceClient(base_url=svc.url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    tok = tc.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("the quick"))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    _train(tc, tok, 1)
    s1 = tc.save_weights_and_get_sampling_client().result()
    _train(tc, tok, 3, lr=0.5)
    s2 = tc.save_weights_and_get_sampling_client().result()
    first = s1.sample(prompt, 1, params).result().sequences[0]
    other = s2.sample(prompt, 1, params).result().sequences[0]
    back = s1.sample(prompt, 1, params).result().sequences[0]
    assert (back.tokens, back.logprobs) == (first.tokens, first.logprobs)
    assert other.logprobs != first.logprobs
    assert len(svc.service._bases["tiny"].generator.loaded) == 1


def test_generator_and_policy_samplers_agree(serve, tmp_path):
    """``sampler: hf`` and ``sampler: policy`` give the same greedy samples (tokens, log-probs
    within float rounding) of a trained snapshot and of the bare base model, the base served
    by a zero adapter once another adapter is loaded in the generator."""
    out = {}
    for kind in ("hf", "policy"):
        svc = serve(sampler=kind, state_dir=str(tmp_path / kind))
        sc = tinker.ServiceClient(base_url=svc.url)
        base = sc.create_sampling_client(base_model="tiny").result()
        tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        tok = tc.get_tokenizer()
        prompt = types.ModelInput.from_ints(tok.encode("the quick"))
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
        before = base.sample(prompt, 1, greedy).result().sequences[0]
        _train(tc, tok, 3, lr=0.1)
        snap = tc.save_weights_and_get_sampling_client().result()
        trained = snap.sample(prompt, 1, greedy).result().sequences[0]
        after = base.sample(prompt, 1, greedy).result().sequences[0]
        assert after.tokens == before.tokens
        np.testing.assert_allclose(after.logprobs, before.logprobs, rtol=0, atol=1e-5)
        assert trained.tokens != before.tokens or trained.logprobs != before.logprobs
        out[kind] = (before, trained)
        if kind == "hf":
            assert len(svc.service._bases["tiny"].generator.loaded) == 2  # snapshot + zero
    for hf, pol in zip(out["hf"], out["policy"], strict=True):
        assert hf.tokens == pol.tokens
        np.testing.assert_allclose(hf.logprobs, pol.logprobs, rtol=0, atol=1e-4)


def _sglang_python():
    try:
        from rl_sglang._cpu_support import default_python
    except ImportError:
        return None
    py = default_python()
    return py if py.exists() else None


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(_sglang_python() is None, reason="SGLang's venv (~/.cache/rl-sglang) absent")
def test_sglang_sampler_serves_pinned_snapshots_per_request(serve, tmp_path):
    """``sampler: sglang``: a real CPU SGLang server launched with LoRA serving; a snapshot is a
    LoRA adapter loaded by name and picked per request. Sampled log-probs equal the training
    client's forward at the snapshot's version (1e-3, another kernel); after more training
    the pinned sampler's samples still score as that version, not the trained-on one."""
    svc = serve(
        sampler="sglang",
        sglang={"log_dir": str(tmp_path / "sglang-logs"), "server_args": {"log_level": "warning"}},
    )
    sc = tinker.ServiceClient(base_url=svc.url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, train_unembed=False).result()
    tok = tc.get_tokenizer()
    _train(tc, tok, 2, lr=0.05)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tok.encode("the quick")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert len(svc.service._bases["tiny"].generator.loaded) == 1
    for seq in res.sequences:
        fwd = _forward_logprobs(tc, prompt, seq.tokens)
        np.testing.assert_allclose(seq.logprobs, fwd, rtol=0, atol=1e-3)
    _train(tc, tok, 3, lr=0.5)
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    pinned = sampler.compute_logprobs(types.ModelInput.from_ints([*prompt, *seq.tokens])).result()
    np.testing.assert_allclose(seq.logprobs, pinned[len(prompt) :], rtol=0, atol=1e-3)
    moved = _forward_logprobs(tc, prompt, seq.tokens)
    assert np.abs(moved - np.asarray(seq.logprobs)).max() > 1e-2
