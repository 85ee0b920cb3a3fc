"""The OpenAI-compatible agent adapter, driven with the official ``openai`` client against the
reference HFGenerator on a tiny random model: exact token ids and log-probs are recorded,
streaming matches non-streaming, tool calls round-trip, turns merge into one rollout when the
next prompt extends the held tokens (also when ``encode(decode(ids)) != ids``), and an agent
program (callable or subprocess) becomes a GenerateFn."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from rl_agents import (  # noqa: E402
    AgentRollout,
    AgentServer,
    AgentTask,
    ChatFormat,
    SessionReward,
    TurnRecord,
    linearize,
)
from rl_core.errors import ConfigError, RewardError  # noqa: E402
from rl_core.interfaces import Generator, RolloutContext  # noqa: E402
from rl_core.types import (  # noqa: E402
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutStatus,
    SamplingParams,
)
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer  # noqa: E402
from rl_hf.tiny import TinyModelSpec  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)


class Recording(Generator):
    """Delegates to a real generator and keeps every result it returned."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner
        self.results: list[GenerationResult] = []
        self.requests: list[GenerationRequest] = []

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = await self.inner.generate(requests)
        self.requests.extend(requests)
        self.results.extend(out)
        return out

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


class Scripted(Generator):
    """Returns scripted texts (encoded, plus EOS) with fixed log-probs: a deterministic engine
    for the tool-call round trip, which a random tiny model would never produce."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.results: list[GenerationResult] = []

    @property
    def weight_version(self) -> int:
        return 3

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in requests:
            ids = tuple(self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False))
            ids += (self.tokenizer.eos_token_id,)
            lps = tuple(-0.25 - 0.01 * i for i in range(len(ids)))
            out.append(
                GenerationResult(
                    request_id=r.request_id,
                    output_ids=ids,
                    output_logprobs=lps,
                    finish_reason=FinishReason.STOP,
                    weight_version=3,
                )
            )
        self.results.extend(out)
        return out

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def hf_gen(tmp_path_factory, tok):
    path = build_tiny_model(
        tmp_path_factory.mktemp("agents_tiny"),
        TinyModelSpec(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
    )
    gen = HFGenerator(HFGenerator.Config(model_path=str(path)))
    yield gen
    asyncio.run(gen.close())


def _serve(gen: Generator, tok, body, **server_opts):
    """Run ``body(server, client)`` with a started server and an AsyncOpenAI client factory."""

    async def main():
        server = AgentServer(AgentServer.Config(**server_opts), generator=gen, tokenizer=tok)
        await server.start()
        clients = []

        def client(sid: str):
            clients.append(openai.AsyncOpenAI(base_url=server.base_url, api_key=sid, max_retries=0))
            return clients[-1]

        try:
            return await body(server, client)
        finally:
            for c in clients:
                await c.close()
            await server.close()

    return asyncio.run(main())


def _chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------ server


def test_non_streaming_records_exact_ids_and_logprobs(hf_gen, tok):
    rec = Recording(hf_gen)
    messages = [{"role": "user", "content": "What is 2+3?"}]

    async def body(server, client):
        models = await client("s1").models.list()
        server.open_session("s1", sampling=SAMPLING)
        resp = await client("s1").chat.completions.create(
            model="policy", messages=messages, max_tokens=8, logprobs=True
        )
        return models, resp, server.finish_session("s1", prompt_uid="p", prompt_ids=[1, 2])

    models, resp, rollouts = _serve(rec, tok, body)
    assert [m.id for m in models.data] == ["policy"]
    (res,) = rec.results
    (req,) = rec.requests
    assert list(req.input_ids) == _chat_ids(tok, messages)  # rendered with the chat template
    assert req.sampling.max_new_tokens == 8 and req.sampling.temperature == 1.0
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert resp.usage.prompt_tokens == len(req.input_ids)
    assert resp.usage.completion_tokens == len(res.output_ids)
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(res.output_logprobs)
    assert choice.finish_reason == ("length" if res.finish_reason == "length" else "stop")
    (r,) = rollouts
    assert r.rollout_id == "s1" and r.prompt_uid == "p"
    assert r.tokens == req.input_ids + res.output_ids  # exactly what was served
    assert r.response_start == len(req.input_ids)
    assert r.loss_mask == (1,) * len(res.output_ids)
    assert r.rollout_logprobs == res.output_logprobs
    assert r.metadata["session_turns"] == 1


def test_streaming_matches_non_streaming(hf_gen, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    async def body(server, client):
        server.open_session("a", sampling=SAMPLING)
        server.open_session("b", sampling=SAMPLING)  # same seed: the same sample
        full = await client("a").chat.completions.create(
            model="policy", messages=messages, max_tokens=20
        )
        stream = await client("b").chat.completions.create(
            model="policy",
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        ra = server.finish_session("a", prompt_uid="p", prompt_ids=[1])
        rb = server.finish_session("b", prompt_uid="p", prompt_ids=[1])
        return full, chunks, ra, rb

    full, chunks, ra, rb = _serve(hf_gen, tok, body)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == (full.choices[0].message.content or "")
    assert len(text) > 0
    assert finish == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert ra[0].tokens == rb[0].tokens and ra[0].rollout_logprobs == rb[0].rollout_logprobs


def test_tool_call_round_trip_merges_into_one_rollout(tok):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2,  "b": 3}}\n</tool_call>'
    gen = Scripted(tok, [f"Let me add.\n{call}", "The answer is 5."])
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
            },
        }
    ]
    messages: list = [{"role": "user", "content": "2+3?"}]

    async def body(server, client):
        server.open_session("t", sampling=SAMPLING)
        c = client("t")
        first = await c.chat.completions.create(model="policy", messages=messages, tools=tools)
        msg = first.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        tc = msg.tool_calls[0]
        args = json.loads(tc.function.arguments)
        messages.append(
            {"role": "tool", "tool_call_id": tc.id, "content": str(args["a"] + args["b"])}
        )
        second = await c.chat.completions.create(
            model="policy", messages=messages, tools=tools, stream=True
        )
        chunks = [x async for x in second]
        return first, chunks, server.finish_session("t", prompt_uid="q", prompt_ids=[1])

    first, chunks, rollouts = _serve(gen, tok, body)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The answer is 5."
    # One trajectory: prompt, turn 1 (mask 1), tool glue + result (mask 0), turn 2 (mask 1).
    (r,) = rollouts
    out1, out2 = (res.output_ids for res in gen.results)
    resp = r.response_ids
    assert resp[: len(out1)] == out1 and resp[-len(out2) :] == out2
    glue = resp[len(out1) : -len(out2)]
    assert "<|im_start|>tool\n5<|im_end|>" in tok.decode(list(glue))
    assert r.loss_mask == (1,) * len(out1) + (0,) * len(glue) + (1,) * len(out2)
    lps = r.rollout_logprobs
    assert lps[: len(out1)] == gen.results[0].output_logprobs
    assert set(lps[len(out1) : -len(out2)]) == {0.0}
    assert r.versions == (3,) * len(resp)
    assert r.metadata["tool_calls"] == 1 and r.metadata["ill_formed"] == 0
    # The tools were described to the model in the system message.
    assert "<tools>" in tok.decode(list(r.tokens[: r.response_start]))


def test_merge_and_fork_with_non_identity_round_trip(hf_gen, tok):
    """Two turns of one conversation merge; an unrelated conversation in the same session starts
    a second rollout with the same rollout_id. The random model samples bytes that are not valid
    UTF-8, so ``encode(decode(ids)) != ids``: the ids must still be exactly the sampled ones."""
    rec = Recording(hf_gen)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=12)

    async def body(server, client):
        server.open_session("m", sampling=sampling)
        c = client("m")
        conv = [{"role": "user", "content": "Tell me something."}]
        r1 = await c.chat.completions.create(model="policy", messages=conv)
        conv += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "More."},
        ]
        await c.chat.completions.create(model="policy", messages=conv)
        other = [{"role": "system", "content": "Sub-agent."}, {"role": "user", "content": "Go"}]
        await c.chat.completions.create(model="policy", messages=other)
        return server.finish_session("m", prompt_uid="p", prompt_ids=[1])

    rollouts = _serve(rec, tok, body)
    outs = [r.output_ids for r in rec.results]
    assert all(r.finish_reason == "length" for r in rec.results)  # seed chosen so: no early EOS
    assert any(tok.encode(tok.decode(list(o)), add_special_tokens=False) != list(o) for o in outs)
    assert len(rollouts) == 2
    merged, forked = rollouts
    assert {merged.rollout_id, forked.rollout_id} == {"m"}
    assert merged.sample_id != forked.sample_id
    p1, p2, p3 = (req.input_ids for req in rec.requests)
    assert p2[: len(p1) + len(outs[0])] == p1 + outs[0]  # turn 2's prompt extends turn 1 exactly
    assert merged.tokens == p2 + outs[1]
    assert merged.loss_mask == (1,) * len(outs[0]) + (0,) * (len(p2) - len(p1) - len(outs[0])) + (
        1,
    ) * len(outs[1])
    assert forked.tokens == p3 + outs[2] and forked.response_start == len(p3)
    assert merged.metadata["num_siblings"] == 2


def test_session_errors(hf_gen, tok):
    async def body(server, client):
        with pytest.raises(openai.AuthenticationError):
            await client("nope").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}]
            )
        server.open_session("e", sampling=SAMPLING)
        with pytest.raises(openai.BadRequestError, match="response_format"):
            await client("e").chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_object"},
            )
        with pytest.raises(openai.BadRequestError, match="messages"):
            await client("e").chat.completions.create(model="policy", messages=[])
        await client("e").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        with pytest.raises(openai.BadRequestError, match="max_turns"):
            await client("e").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "y"}], max_tokens=2
            )
        server.finish_session("e", prompt_uid="p", prompt_ids=[1])
        with pytest.raises(openai.NotFoundError):
            await client("e").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}]
            )

    _serve(hf_gen, tok, body, max_turns=1)


# ------------------------------------------------------------------------------------ pieces


def test_parse_tool_calls():
    p = ChatFormat.parse('hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert p.content == "hi" and p.tool_calls[0].name == "f"
    assert json.loads(p.tool_calls[0].arguments) == {"x": 1}
    bad = ChatFormat.parse("<tool_call>{not json}</tool_call>")
    assert bad.ill_formed and bad.tool_calls == () and bad.content.startswith("<tool_call>")
    assert ChatFormat.parse("<tool_call>{}</tool_call>", tools_enabled=False).tool_calls == ()


def _turn(prompt, out, version=0):
    res = GenerationResult(
        request_id="r",
        output_ids=tuple(out),
        output_logprobs=(-0.5,) * len(out),
        finish_reason=FinishReason.STOP,
        weight_version=version,
    )
    return TurnRecord(
        prompt_ids=tuple(prompt), result=res, prompt_text="", output_text="", raw_content=""
    )


def test_linearize_merges_extensions_and_forks_branches():
    turns = [
        _turn([1, 2], [3, 4]),
        _turn([1, 2, 3, 4, 5], [6], version=1),  # extends turn 1 (tool token 5)
        _turn([1, 2, 3, 4, 9], [7]),  # branches off turn 1's tokens: a new trajectory
        _turn([1, 2, 3, 4, 5, 6, 8], [9]),  # extends the merged trajectory again
    ]
    a, b = linearize(turns)
    assert a.input_ids == (1, 2, 3, 4, 5, 6, 8, 9)
    r = a.to_rollout("p", "s")
    assert r.loss_mask == (1, 1, 0, 1, 0, 1) and r.versions == (0, 0, 0, 1, 1, 0)
    assert b.input_ids == (1, 2, 3, 4, 9, 7) and b.prompt_length == 5


# ------------------------------------------------------------------------------ GenerateFn


def sync_agent(task: AgentTask) -> float:
    """An unmodified two-turn agent using the synchronous OpenAI client."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = task.messages
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=6)
    msgs += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    client.chat.completions.create(model=task.model, messages=msgs, max_tokens=6)
    return 0.75


def broken_agent(task: AgentTask) -> float:
    """Fails after one call."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
    raise RuntimeError("agent crashed")


def _ctx(gen, tok, n):
    return RolloutContext(
        generator=gen, tokenizer=tok, sampling=SAMPLING, n_samples=n, policy_version=0
    )


def _prompt(tok):
    msgs = [{"role": "user", "content": "Count to three."}]
    return Prompt(uid="u0", input=msgs, token_ids=tuple(_chat_ids(tok, msgs)), label="x")


def test_agent_rollout_with_callable(hf_gen, tok):
    fn = AgentRollout(AgentRollout.Config(program=f"{__name__}:sync_agent"))
    prompt = _prompt(tok)

    async def main():
        try:
            return await fn(prompt, _ctx(hf_gen, tok, 3))
        finally:
            await fn.aclose()

    rollouts = asyncio.run(main())
    assert len({r.rollout_id for r in rollouts}) == 3  # one session per sample
    for r in rollouts:
        assert r.status != RolloutStatus.FAILED
        assert r.reward == 0.75 and SessionReward()(prompt, "", r) == 0.75
        assert r.tokens[: r.response_start] == prompt.token_ids  # the agent sent the prompt
        assert r.metadata["session_turns"] == 2
    # Turns merged where the second prompt extended the first (no early EOS / pad stop).
    assert any(sum(r.loss_mask) > 6 for r in rollouts)


def test_agent_rollout_failure_is_counted_not_raised(hf_gen, tok, caplog):
    fn = AgentRollout(AgentRollout.Config(program=f"{__name__}:broken_agent"))

    async def main():
        try:
            return await fn(_prompt(tok), _ctx(hf_gen, tok, 1))
        finally:
            await fn.aclose()

    (r,) = asyncio.run(main())
    assert r.status == RolloutStatus.FAILED and "agent crashed" in r.metadata["failure"]
    assert r.reward is None
    with pytest.raises(RewardError, match="no reward"):
        SessionReward()(_prompt(tok), "", r)
    # The traceback the rollout cannot hold is logged, not swallowed.
    (record,) = [x for x in caplog.records if x.name == "rl_agents.rollout"]
    assert record.levelname == "WARNING" and record.exc_info is not None
    assert "agent crashed" in str(record.exc_info[1])


def test_agent_rollout_with_subprocess(hf_gen, tok, tmp_path: Path):
    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, sys
            import openai
            task = json.loads(sys.stdin.read())
            assert task == json.loads(os.environ["RL_TASK"])
            client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from env
            r = client.chat.completions.create(model="policy", messages=task["input"], max_tokens=5)
            print("log line")
            print(json.dumps({"reward": 0.5 if task["label"] == "x" else 0.0}))
            """
        )
    )
    fn = AgentRollout(AgentRollout.Config(command=[sys.executable, str(script)], timeout_s=120))

    async def main():
        try:
            return await fn(_prompt(tok), _ctx(hf_gen, tok, 2))
        finally:
            await fn.aclose()

    rollouts = asyncio.run(main())
    assert len(rollouts) == 2
    assert all(r.reward == 0.5 and r.status != RolloutStatus.FAILED for r in rollouts)
    assert all("log line" in r.metadata["agent_stdout"] for r in rollouts)


def test_agent_rollout_config_checked_at_load_time():
    with pytest.raises(ConfigError, match="exactly one"):
        AgentRollout.Config()
    with pytest.raises(ConfigError, match="does not match"):
        AgentRollout(AgentRollout.Config(program="json:dumps"))  # fine: one positional arg
        AgentRollout(AgentRollout.Config(program=f"{__name__}:_turn"))  # two required args


# ------------------------------------------------------------------------------- MoE routing


def test_session_rollouts_carry_the_engines_routing_for_every_token(tmp_path, tok):
    """MoE routing replay through the agent server: a session opened with ``return_routing``
    asks the engine for its routing on every completion, and the merged two-turn rollout holds
    one routing row per token (prompt, both completions and the user turn between them), each
    from the engine pass that first ran that token."""
    from rl_hf import TINY_MOE

    inner = HFGenerator(HFGenerator.Config(model_path=str(build_tiny_model(tmp_path, TINY_MOE))))
    gen = Recording(inner)
    messages: list = [{"role": "user", "content": "hi"}]

    async def body(server, client):
        server.open_session("moe", sampling=SAMPLING, return_routing=True)
        server.open_session("dense", sampling=SAMPLING)
        c = client("moe")
        first = await c.chat.completions.create(model="policy", messages=messages)
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        messages.append({"role": "user", "content": "more"})
        await c.chat.completions.create(model="policy", messages=messages)
        await client("dense").chat.completions.create(model="policy", messages=messages[:1])
        moe = server.finish_session("moe", prompt_uid="q", prompt_ids=[1])
        dense = server.finish_session("dense", prompt_uid="q", prompt_ids=[1])
        return moe, dense

    try:
        (moe, dense) = _serve(gen, tok, body)
    finally:
        asyncio.run(inner.close())
    assert [q.return_routing for q in gen.requests] == [True, True, False]
    assert all(r.routed_experts is None for r in dense)
    (r,) = moe  # the second prompt extends the first turn: one trajectory
    routed = r.routed_experts
    n_layers, top_k = TINY_MOE.num_layers, TINY_MOE.moe_top_k
    assert routed is not None and tuple(routed.shape) == (len(r.tokens), n_layers, top_k)
    assert routed.dtype == torch.uint8 and int(routed.max()) < TINY_MOE.num_experts
    res1, res2 = gen.results[:2]
    p1, p2 = len(gen.requests[0].input_ids), len(gen.requests[1].input_ids)
    ran1 = p1 + len(res1.output_ids) - 1  # turn 1's last sampled token was never run
    assert torch.equal(routed[:ran1], res1.routed_experts[:ran1])
    # From there on (turn 1's last token, the user turn, turn 2) the rows are turn 2's.
    end = p2 + len(res2.output_ids) - 1
    assert torch.equal(routed[ran1:end], res2.routed_experts[ran1:end])
