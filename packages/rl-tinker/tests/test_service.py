"""The service driven by the unmodified official ``tinker`` SDK, on a tiny built model."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
types = tinker.types

TEXT = "the quick brown fox jumps over the lazy dog"


def _client(svc):
    return tinker.ServiceClient(base_url=svc.url)


def _datum(tok, text=TEXT, **extra):
    ids = tok.encode(text)
    n = len(ids) - 1
    inputs = {"target_tokens": ids[1:], "weights": [1.0] * n}
    inputs.update({k: v(n) if callable(v) else v for k, v in extra.items()})
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def _lps(out):
    return [np.asarray(o["logprobs"].data, dtype=np.float32) for o in out.loss_fn_outputs]


def _train(tc, tok, steps, lr=1e-2):
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([_datum(tok)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_capabilities_training_sampling_and_checkpoints(serve):
    """Every endpoint once: capabilities, create, forward (log-probs equal the sampler's prompt
    log-probs on the same weights), the three losses, optim_step (loss falls), sample (n,
    max_tokens, stop, seed, log-probs), save_state / load_state (weights restored)."""
    svc = serve()
    sc = _client(svc)
    caps = tinker.RestClient(base_url=svc.url).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    tok = tc.get_tokenizer()
    info = tc.get_info()
    assert info.lora_rank == 4 and info.model_data.model_name == "tiny"

    d = _datum(tok)
    fwd = tc.forward([d], "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt_lps = sampler.compute_logprobs(
        d.model_input.append_int(d.loss_fn_inputs["target_tokens"].data[-1])
    ).result()
    assert prompt_lps[0] is None
    np.testing.assert_allclose(prompt_lps[1:], _lps(fwd)[0], rtol=0, atol=1e-5)

    n = len(d.loss_fn_inputs["target_tokens"].data)
    old = _lps(fwd)[0].tolist()
    for loss_fn, extra in [
        ("importance_sampling", {"logprobs": old, "advantages": [1.0] * n}),
        ("ppo", {"logprobs": old, "advantages": [1.0] * n}),
    ]:
        out = tc.forward([_datum(tok, **extra)], loss_fn).result()
        # At the sampled policy the ratio is 1: both surrogates equal -sum(advantages).
        assert out.metrics["loss:sum"] == pytest.approx(-n, rel=1e-5)
    fails = tc.forward([d], "dro")
    with pytest.raises(Exception, match="not supported"):
        fails.result()

    losses = _train(tc, tok, 4)
    assert losses[-1] < losses[0]

    saved = tc.save_state("ckpt").result().path
    assert saved.startswith("tinker://") and saved.endswith("/weights/ckpt")
    before = _lps(tc.forward([d], "cross_entropy").result())[0]
    _train(tc, tok, 2)
    assert not np.array_equal(_lps(tc.forward([d], "cross_entropy").result())[0], before)
    tc.load_state(saved).result()
    np.testing.assert_array_equal(_lps(tc.forward([d], "cross_entropy").result())[0], before)

    prompt = types.ModelInput.from_ints(tok.encode("the quick"))
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    res = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(res.sequences) == 3
    for s in res.sequences:
        assert len(s.tokens) == 6 and len(s.logprobs) == 6 and s.stop_reason == "length"
        assert all(lp <= 0 for lp in s.logprobs)
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    first = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens[0]
    stop = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[first])
    stopped = sampler.sample(prompt, 1, stop).result().sequences[0]
    assert stopped.tokens == [first] and stopped.stop_reason == "stop"

    named = tc.save_weights_for_sampler("final").result().path
    assert named.endswith("/sampler_weights/final")
    pinned = sc.create_sampling_client(model_path=named).result()
    _train(tc, tok, 1, lr=1.0)  # the trainer moves on; the pinned sampler does not
    again = pinned.sample(prompt, 3, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]


def test_custom_loss_runs_on_the_client_with_the_servers_logprobs(serve):
    """forward_backward_custom (a cross-entropy written by hand) trains exactly as the built-in
    cross_entropy: two tenants from the same seed end with equal weights."""
    svc = serve()
    sc = _client(svc)
    a = sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    b = sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    tok = a.get_tokenizer()
    d = _datum(tok)

    def ce(data, logprobs):
        loss = sum(
            -(lp * torch.tensor(x.loss_fn_inputs["weights"].data)).sum()
            for x, lp in zip(data, logprobs)
        )
        return loss, {"custom:sum": float(loss)}

    for _ in range(2):
        a.forward_backward([d], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out = b.forward_backward_custom([d], ce).result()
        assert "custom:sum" in out.metrics
        b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    la = _lps(a.forward([d], "cross_entropy").result())[0]
    lb = _lps(b.forward([d], "cross_entropy").result())[0]
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)


def test_operations_of_one_client_run_in_submission_order(serve):
    """Submitted without waiting (pipelined through the SDK), forward_backward / optim_step /
    forward give the results of a client that waits on each. (The SDK usually delivers them in
    order; the out-of-order arrival case is the next test.)"""
    svc = serve()
    sc = _client(svc)
    tok = None
    results = []
    for wait in (True, False):
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        tok = tok or tc.get_tokenizer()
        d = _datum(tok)
        futures = []
        for _ in range(3):
            futures.append(tc.forward_backward([d], "cross_entropy"))
            if wait:
                futures[-1].result()
            futures.append(tc.optim_step(types.AdamParams(learning_rate=1e-2)))
            if wait:
                futures[-1].result()
        futures.append(tc.forward([d], "cross_entropy"))
        out = [f.result() for f in futures]
        results.append(([o.metrics["loss:sum"] for o in out[0::2][:3]], _lps(out[-1])[0]))
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_a_diverging_tenant_leaves_another_bitwise_unchanged(serve):
    """Tenant A trains with a huge learning rate until its loss is NaN; tenant B's losses and
    log-probs are bitwise those of B trained alone on a fresh service."""

    def run_b(tc, tok):
        losses = _train(tc, tok, 3)
        return losses, _lps(tc.forward([_datum(tok)], "cross_entropy").result())[0]

    solo_svc = serve()
    sc = _client(solo_svc)
    b = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tok = b.get_tokenizer()
    solo = run_b(b, tok)
    solo_svc.stop()

    svc = serve()
    sc = _client(svc)
    a = sc.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    b = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    a_losses = []
    for _ in range(3):  # interleaved with B's steps below
        a.forward_backward([_datum(tok)], "cross_entropy")
        a.optim_step(types.AdamParams(learning_rate=1e30))
    shared = run_b(b, tok)
    a_losses = [a.forward([_datum(tok)], "cross_entropy").result().metrics["loss:sum"]]
    assert not np.isfinite(a_losses[-1]) or a_losses[-1] > 1e3
    assert shared[0] == solo[0]
    np.testing.assert_array_equal(shared[1], solo[1])


def test_restart_resumes_adapter_and_optimizer_state(serve, tmp_path):
    """Train 2 steps, save_state, stop the service; a new service on the same state_dir loads
    the state with its optimizer and the next 2 steps equal those of an uninterrupted run."""
    state = str(tmp_path / "shared-state")
    svc = serve(state_dir=state)
    sc = _client(svc)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    tok = tc.get_tokenizer()
    _train(tc, tok, 2)
    path = tc.save_state("mid").result().path
    straight = _train(tc, tok, 2)
    svc.stop()

    svc2 = serve(state_dir=state)
    sc2 = _client(svc2)
    resumed_tc = sc2.create_training_client_from_state_with_optimizer(path).result()
    resumed = _train(resumed_tc, tok, 2)
    assert resumed == straight
    weights_only = sc2.create_training_client_from_state(path).result()
    assert _train(weights_only, tok, 2) != straight  # fresh Adam moments: a different step


def test_limits_answer_clear_4xx_errors(serve):
    """Adapters per session and queued operations per client are capped; the SDK raises the
    service's message. Unknown base models and checkpoint paths are 4xx too."""
    svc = serve(max_models_per_session=1, max_queued_per_model=1)
    sc = _client(svc)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="max_models_per_session"):
        sc.create_lora_training_client(base_model="tiny", rank=4).result()
    tok = tc.get_tokenizer()
    long = _datum(tok, TEXT * 20)
    futures = [tc.forward_backward([long], "cross_entropy") for _ in range(8)]
    errors = []
    for f in futures:
        try:
            f.result()
        except tinker.BadRequestError as e:
            errors.append(str(e))
    assert errors and all("max_queued_per_model" in e for e in errors)

    sc2 = _client(svc)
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        sc2.create_lora_training_client(base_model="llama", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="no such checkpoint"):
        sc2.create_training_client_from_state("tinker://nobody:train:0/weights/none").result()


def test_multi_lora_batch_equals_each_tenant_alone(tiny_model):
    """Backend: three tenants' forward_backward as one multi-LoRA batch give each tenant the
    log-probs, loss and adapter gradients of its own solo call (within float rounding), and
    touch no other adapter's gradients."""
    from rl_tinker.backend import BaseModel, DatumInput, LoraSpec

    base = BaseModel("tiny", tiny_model)
    tok = base.tokenizer
    tenants = [base.new_tenant(f"m{i}", LoraSpec(rank=4, seed=i)) for i in range(3)]
    bystander = base.new_tenant("idle", LoraSpec(rank=4, seed=9))
    for t in tenants:  # non-zero B so that each adapter changes the forward
        torch.nn.init.normal_(t.params[-1][1], std=0.5)

    def data(text):
        ids = np.asarray(tok.encode(text), dtype=np.int64)
        return [
            DatumInput(
                tokens=ids[:-1],
                inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, np.float32)},
            )
        ]

    texts = ["hello there", "a much longer sentence than the first one", "mid length text"]
    solo = []
    for t, text in zip(tenants, texts):
        out, metrics = base.forward_backward(t, data(text), "cross_entropy", {}, backward=True)
        solo.append((out, metrics, [p.grad.clone() for _, p in t.params]))
        for _, p in t.params:
            p.grad = None
    many = base.forward_backward_many(
        [(t, data(x), "cross_entropy", {}) for t, x in zip(tenants, texts)], backward=True
    )
    for (out, metrics, grads), (bout, bmetrics), t in zip(solo, many, tenants):
        np.testing.assert_allclose(bout[0]["logprobs"], out[0]["logprobs"], atol=1e-5)
        assert bmetrics["loss:sum"] == pytest.approx(metrics["loss:sum"], rel=1e-5)
        for g, (_, p) in zip(grads, t.params):
            torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-3)
    assert all(p.grad is None for _, p in bystander.params)


def test_batched_tenants_through_the_sdk_match_solo_runs(serve):
    """With batch_tenants on, two tenants training concurrently end with the losses of their
    solo runs within float rounding."""
    import threading

    def run(sc, seed, out):
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
        out[seed] = _train(tc, tc.get_tokenizer(), 3)

    solo = {}
    svc = serve()
    for seed in (1, 2):
        run(_client(svc), seed, solo)
    svc = serve(batch_tenants=True)
    sc = _client(svc)
    both = {}
    threads = [threading.Thread(target=run, args=(sc, seed, both)) for seed in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for seed in (1, 2):
        np.testing.assert_allclose(both[seed], solo[seed], rtol=1e-4)


def test_smollm2_trains_and_samples_through_the_sdk(serve):
    """The converted SmolLM2-135M-Instruct: loss falls over 3 steps on one datum, and a chat
    prompt sampled greedily stops at the model's end-of-turn token."""
    from rl_hf.convert import smollm2_135m_instruct

    path = smollm2_135m_instruct()
    svc = serve(models={"smollm2": str(path)})
    sc = _client(svc)
    tc = sc.create_lora_training_client(base_model="smollm2", rank=4).result()
    tok = tc.get_tokenizer()
    losses = _train(tc, tok, 3, lr=1e-3)
    assert losses[-1] < losses[0]
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True
    )
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    seq = (
        sampler.sample(
            tinker.types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=40, temperature=0.0),
        )
        .result()
        .sequences[0]
    )
    assert seq.stop_reason == "stop" and seq.tokens[-1] in (
        tok.eos_token_id,
        tok.convert_tokens_to_ids("<|im_end|>"),
    )


def test_closing_a_session_frees_its_training_clients(serve):
    """The SDK's close ends the session: its adapters go, so the service-wide limit frees up."""
    svc = serve(max_models=1)
    sc = _client(svc)
    sc.create_lora_training_client(base_model="tiny", rank=4).result()
    sc2 = _client(svc)
    with pytest.raises(tinker.BadRequestError, match="max_models"):
        sc2.create_lora_training_client(base_model="tiny", rank=4).result()
    sc.close("success").result()
    tc = sc2.create_lora_training_client(base_model="tiny", rank=4).result()
    assert (
        tc.forward([_datum(tc.get_tokenizer())], "cross_entropy").result().metrics["loss:sum"] > 0
    )


def test_operations_arriving_out_of_order_run_in_seq_id_order(tmp_path):
    """The SDK numbers a client's operations and may send them concurrently (chunks of one
    forward_backward); the service runs them by seq_id whatever the arrival order, and refuses
    a seq_id used twice."""
    from rl_tinker.backend import LoraSpec, Tenant
    from rl_tinker.config import ServiceConfig
    from rl_tinker.server import TinkerService, _HTTPError, _Model

    svc = TinkerService(ServiceConfig(models={"m": str(tmp_path)}, state_dir=str(tmp_path / "s")))
    ran = []
    svc._run = lambda fut, work, on_done=None: ran.append(work())
    model = _Model(
        tenant=Tenant(model_id="m:train:0", base=None, adapter="", lora=LoraSpec(rank=1)),
        session_id="s",
    )
    try:
        for seq in (3, 1, 4, 2):
            svc._ordered(model, seq, svc._new_future("op", "m:train:0"), lambda seq=seq: seq)
            if seq == 1:
                assert ran == [1]
        assert ran == [1, 2, 3, 4]
        with pytest.raises(_HTTPError, match="already used"):
            svc._ordered(model, 2, svc._new_future("op", "m:train:0"), lambda: 0)
    finally:
        svc.close()


def test_queued_work_limit_counts_running_and_waiting_operations(tmp_path):
    """max_queued_per_model counts operations submitted and not finished (running, or waiting
    for an earlier seq_id); the next one is refused with the limit's name."""
    from rl_tinker.backend import LoraSpec, Tenant
    from rl_tinker.config import ServiceConfig
    from rl_tinker.server import TinkerService, _HTTPError, _Model

    svc = TinkerService(
        ServiceConfig(
            models={"m": str(tmp_path)}, state_dir=str(tmp_path / "s"), max_queued_per_model=2
        )
    )
    svc._run = lambda fut, work, on_done=None: None  # never finishes: stays in flight
    model = _Model(
        tenant=Tenant(model_id="m:train:0", base=None, adapter="", lora=LoraSpec(rank=1)),
        session_id="s",
    )
    try:
        svc._ordered(model, 1, svc._new_future("op", "m:train:0"), lambda: 0)  # running
        svc._ordered(model, 3, svc._new_future("op", "m:train:0"), lambda: 0)  # waiting for 2
        with pytest.raises(_HTTPError, match="max_queued_per_model") as err:
            svc._ordered(model, 2, svc._new_future("op", "m:train:0"), lambda: 0)
        assert err.value.status == 400
    finally:
        svc.close()


def test_sdk_sessions_end_with_their_service(serve):
    """The fixture closes the SDK's clients when their service stops (here: by the test), so no
    session heartbeat runs on against a stopped service ("Session heartbeat failed" warnings at
    the end of a test run)."""
    svc = serve()
    sc = _client(svc)
    sc.create_lora_training_client(base_model="tiny", rank=4).result()
    heartbeat = sc._session_holder._session_heartbeat_task  # the SDK has no public view of it
    assert not heartbeat.done()
    svc.stop()
    assert heartbeat.done() and sc._closed  # cancelled: the close waited for it
