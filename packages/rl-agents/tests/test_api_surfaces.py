"""The Anthropic Messages and OpenAI Responses surfaces of the agent server, driven with the
official ``anthropic`` and ``openai`` clients: exact ids and log-probs are recorded, streaming
matches non-streaming, tool calls round-trip into one merged rollout, concurrent agents never
mix, and a history that renders back differently is flagged instead of re-encoded."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Sequence

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from rl_agents import AgentServer  # noqa: E402
from rl_core.interfaces import Generator  # noqa: E402
from rl_core.types import (  # noqa: E402
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer  # noqa: E402
from rl_hf.tiny import TinyModelSpec  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class Scripted(Generator):
    """Returns scripted texts (encoded, plus EOS) with fixed log-probs; a text may be a function
    of the prompt text. ``delay`` adds a random pause (to interleave concurrent requests)."""

    def __init__(self, tokenizer, texts, *, delay: float = 0.0) -> None:
        self.tokenizer, self.texts, self.delay = tokenizer, list(texts), delay
        self.results: list[GenerationResult] = []
        self.requests: list[GenerationRequest] = []

    @property
    def weight_version(self) -> int:
        return 3

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in requests:
            if self.delay:
                await asyncio.sleep(random.random() * self.delay)
            text = self.texts[0] if callable(self.texts[0]) else self.texts.pop(0)
            if callable(text):
                text = text(self.tokenizer.decode(list(r.input_ids)))
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
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
        self.requests.extend(requests)
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
        tmp_path_factory.mktemp("api_tiny"),
        TinyModelSpec(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
    )
    gen = HFGenerator(HFGenerator.Config(model_path=str(path)))
    yield gen
    asyncio.run(gen.close())


def _serve(gen: Generator, tok, body, **server_opts):
    """Run ``body(server, oa, an)`` with a started server; ``oa(sid)`` / ``an(sid)`` make async
    OpenAI / Anthropic clients for a session."""

    async def main():
        server = AgentServer(AgentServer.Config(**server_opts), generator=gen, tokenizer=tok)
        await server.start()
        clients = []

        def oa(sid: str):
            c = openai.AsyncOpenAI(base_url=server.base_url, api_key=sid, max_retries=0)
            clients.append(c)
            return c

        def an(sid: str):
            c = anthropic.AsyncAnthropic(base_url=server.root_url, api_key=sid, max_retries=0)
            clients.append(c)
            return c

        try:
            return await body(server, oa, an)
        finally:
            for c in clients:
                await c.close()
            await server.close()

    return asyncio.run(main())


def _chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
}


class Recording(Generator):
    """Delegates to a real generator and keeps every request and result."""

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


# ------------------------------------------------------------------------------- anthropic


def test_anthropic_records_exact_ids_and_streaming_matches(hf_gen, tok):
    """System prompt + user text are rendered with the chat template; the ids and log-probs the
    engine returned are the rollout's; a stream assembles the same message."""
    rec = Recording(hf_gen)
    system = "Be brief."
    user = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]

    async def body(server, oa, an):
        server.open_session("a", sampling=SAMPLING)
        server.open_session("b", sampling=SAMPLING)  # same seed: the same sample
        full = await an("a").messages.create(
            model="policy", max_tokens=20, system=system, messages=user
        )
        async with an("b").messages.stream(
            model="policy", max_tokens=20, system=system, messages=user
        ) as stream:
            events = [e.type async for e in stream]
            streamed = await stream.get_final_message()
        ra = server.finish_session("a", prompt_uid="p", prompt_ids=[1])
        rb = server.finish_session("b", prompt_uid="p", prompt_ids=[1])
        return full, streamed, events, ra, rb

    full, streamed, events, ra, rb = _serve(rec, tok, body)
    want_ids = _chat_ids(
        tok, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    )
    req, res = rec.requests[0], rec.results[0]
    assert list(req.input_ids) == want_ids and req.sampling.max_new_tokens == 12
    assert full.role == "assistant" and full.model == "policy"
    assert full.stop_reason == ("max_tokens" if res.finish_reason == "length" else "end_turn")
    assert full.usage.input_tokens == len(want_ids)
    assert full.usage.output_tokens == len(res.output_ids)
    (r,) = ra
    assert r.tokens == req.input_ids + res.output_ids and r.rollout_id == "a"
    assert r.rollout_logprobs == res.output_logprobs and r.loss_mask == (1,) * len(res.output_ids)
    assert events[0] == "message_start" and "message_stop" in events
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in full.content]
    assert streamed.stop_reason == full.stop_reason
    assert streamed.usage.output_tokens == full.usage.output_tokens
    assert ra[0].tokens == rb[0].tokens and ra[0].rollout_logprobs == rb[0].rollout_logprobs


def test_anthropic_tool_use_round_trip_merges_into_one_rollout(tok):
    gen = Scripted(tok, [f"Let me add.\n{CALL}", "The answer is 5."])
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": ADD_SCHEMA}]
    messages: list = [{"role": "user", "content": "2+3?"}]

    async def body(server, oa, an):
        server.open_session("t", sampling=SAMPLING)
        c = an("t")
        first = await c.messages.create(
            model="policy", max_tokens=64, messages=messages, tools=tools
        )
        messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
        use = next(b for b in first.content if b.type == "tool_use")
        result = {
            "type": "tool_result",
            "tool_use_id": use.id,
            "content": str(use.input["a"] + use.input["b"]),
        }
        messages.append({"role": "user", "content": [result]})
        async with c.messages.stream(
            model="policy", max_tokens=64, messages=messages, tools=tools
        ) as stream:
            second = await stream.get_final_message()
        return first, second, server.finish_session("t", prompt_uid="q", prompt_ids=[1])

    first, second, rollouts = _serve(gen, tok, body)
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.type == "text" and text.text == "Let me add."
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
    assert second.stop_reason == "end_turn" and second.content[0].text == "The answer is 5."
    (r,) = rollouts  # the tool result extends the held tokens: one trajectory
    out1, out2 = (res.output_ids for res in gen.results)
    resp = r.response_ids
    assert resp[: len(out1)] == out1 and resp[-len(out2) :] == out2
    glue = resp[len(out1) : -len(out2)]
    assert "<|im_start|>tool\n5<|im_end|>" in tok.decode(list(glue))
    assert r.loss_mask == (1,) * len(out1) + (0,) * len(glue) + (1,) * len(out2)
    assert r.metadata["tool_calls"] == 1 and r.metadata["template_mismatch"] == 0
    assert "<tools>" in tok.decode(list(r.tokens[: r.response_start]))


def test_anthropic_errors_are_anthropic_errors(tok):
    async def body(server, oa, an):
        server.open_session("e", sampling=SAMPLING)
        msgs = [{"role": "user", "content": "x"}]
        errors = []
        for call in (
            lambda: an("nobody").messages.create(model="policy", max_tokens=4, messages=msgs),
            lambda: an("e").messages.create(
                model="policy", max_tokens=4, messages=msgs, tool_choice={"type": "any"}
            ),
            lambda: an("e").messages.create(
                model="policy",
                max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
            ),
        ):
            with pytest.raises(anthropic.APIStatusError) as info:
                await call()
            errors.append(info.value)
        return errors

    unknown, stop, image = _serve(Scripted(tok, ["x"]), tok, body)
    assert isinstance(unknown, anthropic.AuthenticationError) and "not open" in str(unknown)
    assert isinstance(stop, anthropic.BadRequestError) and "tool_choice" in str(stop)
    assert isinstance(image, anthropic.BadRequestError) and "'image'" in str(image)


# ------------------------------------------------------------------------------- responses


def test_responses_records_exact_ids_and_streaming_matches(hf_gen, tok):
    rec = Recording(hf_gen)

    async def body(server, oa, an):
        server.open_session("a", sampling=SAMPLING)
        server.open_session("b", sampling=SAMPLING)
        full = await oa("a").responses.create(
            model="policy", instructions="Be brief.", input="Hi", max_output_tokens=20
        )
        # A length-limited reply ends with response.incomplete, which the SDK's stream()
        # helper does not accept: read the raw event stream.
        stream = await oa("b").responses.create(
            model="policy", instructions="Be brief.", input="Hi", max_output_tokens=20, stream=True
        )
        events = [e async for e in stream]
        streamed = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == streamed.output_text
        events = [e.type for e in events]
        ra = server.finish_session("a", prompt_uid="p", prompt_ids=[1])
        rb = server.finish_session("b", prompt_uid="p", prompt_ids=[1])
        return full, streamed, events, ra, rb

    full, streamed, events, ra, rb = _serve(rec, tok, body)
    want = _chat_ids(
        tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    req, res = rec.requests[0], rec.results[0]
    assert list(req.input_ids) == want
    assert full.usage.input_tokens == len(want) and full.usage.output_tokens == len(res.output_ids)
    assert full.status == ("incomplete" if res.finish_reason == "length" else "completed")
    assert ra[0].tokens == req.input_ids + res.output_ids
    assert ra[0].rollout_logprobs == res.output_logprobs
    assert events[0] == "response.created" and events[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert streamed.output_text == full.output_text and len(full.output_text) > 0
    assert ra[0].tokens == rb[0].tokens


def test_responses_function_call_round_trip_with_previous_response_id(tok):
    """Turn 2 continues turn 1 twice over: once by re-sending the items, once through
    ``previous_response_id``; both merge into turn 1's tokens (one trajectory each)."""
    gen = Scripted(tok, [f"Let me add.\n{CALL}", "It is 5.", "Five."])
    tools = [{"type": "function", "name": "add", "description": "Add.", "parameters": ADD_SCHEMA}]

    async def body(server, oa, an):
        server.open_session("r", sampling=SAMPLING)
        c = oa("r")
        first = await c.responses.create(model="policy", input="2+3?", tools=tools)
        call = next(o for o in first.output if o.type == "function_call")
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
        items = [
            {"role": "user", "content": "2+3?"},
            *[o.model_dump() for o in first.output],
            output,
        ]
        resent = await c.responses.create(model="policy", input=items, tools=tools)
        chained = await c.responses.create(
            model="policy", input=[output], tools=tools, previous_response_id=first.id
        )
        return first, resent, chained, server.finish_session("r", prompt_uid="q", prompt_ids=[1])

    first, resent, chained, rollouts = _serve(gen, tok, body)
    kinds = [o.type for o in first.output]
    assert kinds == ["message", "function_call"]
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    assert resent.output_text == "It is 5." and chained.output_text == "Five."
    # Both continuations extend turn 1 exactly: same prompt ids, each its own branch.
    p2, p3 = gen.requests[1].input_ids, gen.requests[2].input_ids
    assert p2 == p3
    held = gen.requests[0].input_ids + gen.results[0].output_ids
    assert p2[: len(held)] == held
    assert len(rollouts) == 2 and {r.rollout_id for r in rollouts} == {"r"}
    assert all(r.metadata["template_mismatch"] == 0 for r in rollouts)


def test_responses_errors(tok):
    async def body(server, oa, an):
        server.open_session("e", sampling=SAMPLING)
        errors = []
        for kwargs in (
            {"input": "x", "previous_response_id": "resp_nope"},
            {"input": "x", "tools": [{"type": "web_search"}]},
            {"input": "x", "tool_choice": "required"},
        ):
            with pytest.raises(openai.APIStatusError) as info:
                await oa("e").responses.create(model="policy", **kwargs)
            errors.append(info.value)
        return errors

    missing, builtin, required = _serve(Scripted(tok, ["x"]), tok, body)
    assert missing.status_code == 404 and "resp_nope" in str(missing)
    assert builtin.status_code == 400 and "function tools" in str(builtin)
    assert required.status_code == 400 and "tool_choice" in str(required)


# ------------------------------------------------------------------------------- sessions


def test_concurrent_agents_on_three_apis_never_mix(tok):
    """Twelve agents (four per API), two turns each, interleaved by random engine delays: every
    session records only its own prompts, and every reply answers its own agent."""
    gen = Scripted(tok, [lambda text: "re " + re.findall(r"agent(\d+)", text)[-1]], delay=0.02)

    async def agent(server, oa, an, k: int):
        sid = f"s{k}"
        server.open_session(sid, sampling=SAMPLING)
        replies = []
        if k % 3 == 0:
            c = oa(sid)
            msgs = [{"role": "user", "content": f"agent{k}"}]
            for _ in range(2):
                r = await c.chat.completions.create(model="policy", messages=msgs)
                replies.append(r.choices[0].message.content)
                msgs += [
                    {"role": "assistant", "content": replies[-1]},
                    {"role": "user", "content": f"agent{k}"},
                ]
        elif k % 3 == 1:
            c = an(sid)
            msgs = [{"role": "user", "content": f"agent{k}"}]
            for _ in range(2):
                r = await c.messages.create(model="policy", max_tokens=8, messages=msgs)
                replies.append(r.content[0].text)
                msgs += [
                    {"role": "assistant", "content": replies[-1]},
                    {"role": "user", "content": f"agent{k}"},
                ]
        else:
            c = oa(sid)
            r = await c.responses.create(model="policy", input=f"agent{k}")
            replies.append(r.output_text)
            r = await c.responses.create(
                model="policy", input=f"agent{k}", previous_response_id=r.id
            )
            replies.append(r.output_text)
        return replies, server.finish_session(sid, prompt_uid=f"p{k}", prompt_ids=[1])

    async def body(server, oa, an):
        return await asyncio.gather(*(agent(server, oa, an, k) for k in range(12)))

    results = _serve(gen, tok, body)
    for k, (replies, rollouts) in enumerate(results):
        assert replies == [f"re {k}", f"re {k}"]
        (r,) = rollouts  # turn 2 extends turn 1 in every API
        assert r.rollout_id == f"s{k}" and r.metadata["session_turns"] == 2
        text = tok.decode(list(r.tokens))
        assert set(re.findall(r"agent(\d+)", text)) == {str(k)}
        assert set(re.findall(r"re (\d+)", text)) == {str(k)}


def test_rerendered_history_is_flagged_not_reencoded(tok):
    """An agent that sends an earlier reply back changed (as a template that rewrites history
    would): the new turn starts its own trajectory, the first keeps its sampled tokens, and the
    rollouts carry ``template_mismatch``."""
    gen = Scripted(tok, ["  Hello there.", "Bye."])

    async def body(server, oa, an):
        server.open_session("h", sampling=SAMPLING)
        c = oa("h")
        msgs = [{"role": "user", "content": "hi"}]
        r = await c.chat.completions.create(model="policy", messages=msgs)
        edited = r.choices[0].message.content.strip()  # what the model wrote, changed
        msgs += [{"role": "assistant", "content": edited}, {"role": "user", "content": "ok"}]
        await c.chat.completions.create(model="policy", messages=msgs)
        return server.sessions["h"].turns, server.finish_session(
            "h", prompt_uid="p", prompt_ids=[1]
        )

    turns, rollouts = _serve(gen, tok, body)
    assert [t.rerendered_turn for t in turns] == [None, 0]
    first, second = rollouts
    assert first.tokens == gen.requests[0].input_ids + gen.results[0].output_ids
    assert second.tokens[: second.response_start] == gen.requests[1].input_ids
    assert "Hello there." in tok.decode(list(second.tokens[: second.response_start]))
    assert all(r.metadata["template_mismatch"] == 1 for r in rollouts)
