"""Real streaming through the agent server: with a generator that streams, the official
``openai`` and ``anthropic`` clients get the first content before the generation has finished
(a generator that holds its last token until the test saw content), what they assemble and the
recorded tokens equal the non-streamed ones; stop strings and tool calls are never streamed as
content; a client that disconnects mid-stream aborts the generation and records nothing; the
HF generator streams through the server with the same trajectory as non-streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from rl_agents import AgentServer  # noqa: E402
from rl_core.interfaces import GenerationChunk, Generator  # noqa: E402
from rl_core.types import (  # noqa: E402
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer  # noqa: E402
from rl_hf.tiny import TinyModelSpec  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64, seed=7)
TEXT = "Hello there, this streams one token at a time."
MESSAGES = [{"role": "user", "content": "hi"}]


class Gated(Generator):
    """Streams a scripted text token by token (then EOS); with ``gated``, the last chunk waits
    until the test opens ``gate`` (so the test sees content before the generation ends)."""

    streams_tokens = True
    supports_abort = True

    def __init__(self, tokenizer, text: str, *, gated: bool = True) -> None:
        self.tokenizer, self.text, self.gated = tokenizer, text, gated
        self.gate = asyncio.Event()
        self.finished = 0
        self.aborted: list[str] = []

    @property
    def weight_version(self) -> int:
        return 1

    def _result(self, r: GenerationRequest) -> GenerationResult:
        ids = tuple(self.tokenizer.encode(self.text, add_special_tokens=False))
        ids += (self.tokenizer.eos_token_id,)
        return GenerationResult(
            request_id=r.request_id,
            output_ids=ids,
            output_logprobs=tuple(-0.5 - 0.01 * i for i in range(len(ids))),
            finish_reason=FinishReason.STOP,
            weight_version=1,
        )

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.finished += len(requests)
        return [self._result(r) for r in requests]

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        res = self._result(request)
        for k in range(len(res.output_ids) - 1):
            await asyncio.sleep(0)
            if request.request_id in self.aborted:
                cut = GenerationResult(
                    request_id=request.request_id,
                    output_ids=res.output_ids[:k],
                    output_logprobs=res.output_logprobs[:k],
                    finish_reason=FinishReason.ABORT,
                    weight_version=1,
                )
                yield GenerationChunk((), (), cut)
                return
            yield GenerationChunk(res.output_ids[k : k + 1], res.output_logprobs[k : k + 1])
        if self.gated:
            await asyncio.wait_for(self.gate.wait(), 10)
        self.finished += 1
        yield GenerationChunk(res.output_ids[-1:], res.output_logprobs[-1:], res)

    async def abort(self, request_ids=None) -> None:
        self.aborted.extend(request_ids or [])

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _serve(gen: Generator, tok, body):
    async def main():
        server = AgentServer(AgentServer.Config(), generator=gen, tokenizer=tok)
        await server.start()
        oa = openai.AsyncOpenAI(base_url=server.base_url, api_key="s", max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=server.root_url, api_key="s", max_retries=0)
        try:
            return await body(server, oa, an)
        finally:
            await oa.close()
            await an.close()
            await server.close()

    return asyncio.run(main())


def _rollout(server: AgentServer, sid: str):
    (r,) = server.finish_session(sid, prompt_uid="p", prompt_ids=(1,), reward=0.0)
    return r


def test_openai_chat_stream_sends_content_before_the_generation_ends(tok):
    gen = Gated(tok, TEXT)

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        stream = await oa.chat.completions.create(model="policy", messages=MESSAGES, stream=True)
        pieces, finished_at_first = [], None
        async for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                if finished_at_first is None:
                    finished_at_first = gen.finished
                    gen.gate.set()
                pieces.append(delta)
        streamed = _rollout(server, "s")
        gen.gated = False
        server.open_session("s2", sampling=SAMPLING)
        full = await oa.chat.completions.create(
            model="policy", messages=MESSAGES, extra_headers={"X-Session-Id": "s2"}
        )
        return pieces, finished_at_first, streamed, _rollout(server, "s2"), full

    pieces, finished_at_first, streamed, plain, full = _serve(gen, tok, body)
    assert finished_at_first == 0  # content arrived while the generation was held
    assert len(pieces) > 3  # token by token, not one piece
    assert "".join(pieces) == full.choices[0].message.content == TEXT
    assert streamed.tokens == plain.tokens and streamed.rollout_logprobs == plain.rollout_logprobs
    assert streamed.loss_mask == plain.loss_mask


def test_anthropic_stream_sends_text_before_the_generation_ends(tok):
    gen = Gated(tok, TEXT)

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        finished_at_first, pieces = None, []
        async with an.messages.stream(model="policy", max_tokens=64, messages=MESSAGES) as s:
            async for text in s.text_stream:
                if finished_at_first is None:
                    finished_at_first = gen.finished
                    gen.gate.set()
                pieces.append(text)
            msg = await s.get_final_message()
        streamed = _rollout(server, "s")
        gen.gated = False
        server.open_session("s2", sampling=SAMPLING)
        full = await an.messages.create(
            model="policy", max_tokens=64, messages=MESSAGES, extra_headers={"X-Session-Id": "s2"}
        )
        return pieces, finished_at_first, msg, full, streamed, _rollout(server, "s2")

    pieces, finished_at_first, msg, full, streamed, plain = _serve(gen, tok, body)
    assert finished_at_first == 0 and len(pieces) > 3
    assert "".join(pieces) == TEXT
    assert [b.model_dump() for b in msg.content] == [b.model_dump() for b in full.content]
    assert msg.stop_reason == full.stop_reason == "end_turn"
    assert streamed.tokens == plain.tokens and streamed.rollout_logprobs == plain.rollout_logprobs


def test_responses_stream_sends_text_before_the_generation_ends(tok):
    gen = Gated(tok, TEXT)

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        stream = await oa.responses.create(model="policy", input="hi", stream=True)
        finished_at_first, pieces, final, kinds = None, [], None, []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                if finished_at_first is None:
                    finished_at_first = gen.finished
                    gen.gate.set()
                pieces.append(event.delta)
            if event.type == "response.completed":
                final = event.response
        streamed = _rollout(server, "s")
        gen.gated = False
        server.open_session("s2", sampling=SAMPLING)
        full = await oa.responses.create(
            model="policy", input="hi", extra_headers={"X-Session-Id": "s2"}
        )
        return pieces, finished_at_first, final, full, kinds, streamed, _rollout(server, "s2")

    pieces, finished_at_first, final, full, kinds, streamed, plain = _serve(gen, tok, body)
    assert finished_at_first == 0 and len(pieces) > 3
    assert "".join(pieces) == final.output_text == full.output_text == TEXT
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["message"]
    assert streamed.tokens == plain.tokens
    assert streamed.rollout_logprobs == plain.rollout_logprobs


@pytest.mark.parametrize(
    ("text", "stop", "content"),
    [
        ("Sure thing. STOP and more text", ["STOP"], "Sure thing. "),
        (
            "Adding now.  \n<tool_call>\n" + '{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
            None,
            "Adding now.",
        ),
        (
            "Adding <tool_call>\n" + '{"name": "add", "arguments": {}}\n</tool_call>\n then more',
            None,
            "Adding\nthen more",
        ),
        (
            "Adding now.<tool_call>\n" + '{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
            None,
            "Adding now.",
        ),
    ],
)
def test_stop_strings_and_tool_calls_are_not_streamed_as_content(tok, text, stop, content):
    gen = Gated(tok, text, gated=False)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        stream = await oa.chat.completions.create(
            model="policy", messages=MESSAGES, stream=True, stop=stop, tools=tools
        )
        pieces, calls, finish = [], [], None
        async for chunk in stream:
            d = chunk.choices[0].delta
            pieces.append(d.content or "")
            calls.extend(d.tool_calls or [])
            finish = chunk.choices[0].finish_reason or finish
        server.open_session("s2", sampling=SAMPLING)
        full = await oa.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            stop=stop,
            tools=tools,
            extra_headers={"X-Session-Id": "s2"},
        )
        return pieces, calls, finish, full, _rollout(server, "s"), _rollout(server, "s2")

    pieces, calls, finish, full, streamed, plain = _serve(gen, tok, body)
    assert "".join(pieces) == content == full.choices[0].message.content
    for k in range(len(pieces)):  # no prefix of what was sent ever held a cut piece
        sent = "".join(pieces[: k + 1])
        assert "<" not in sent and "ST" not in sent
    assert finish == full.choices[0].finish_reason
    assert [c.function.name for c in calls] == [
        c.function.name for c in full.choices[0].message.tool_calls or []
    ]
    assert streamed.tokens == plain.tokens and streamed.rollout_logprobs == plain.rollout_logprobs
    if stop:  # both requests were aborted once the stop string was complete, not run to EOS
        assert len(gen.aborted) == 2 and gen.finished == 0
        assert tok.decode(list(streamed.tokens[streamed.response_start :])).endswith("STOP")


def test_client_disconnect_mid_stream_aborts_and_records_nothing(tok):
    gen = Gated(tok, TEXT)

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        async with aiohttp.ClientSession() as http:
            resp = await http.post(
                f"{server.base_url}/chat/completions",
                json={"model": "policy", "messages": MESSAGES, "stream": True},
                headers={"Authorization": "Bearer s"},
            )
            async for line in resp.content:
                if b'"content": "' in line and b'"content": ""' not in line:
                    break
            resp.close()  # the agent goes away mid-stream
        for _ in range(100):
            if gen.aborted:
                break
            await asyncio.sleep(0.02)
        gen.gate.set()
        await asyncio.sleep(0.1)
        return list(gen.aborted), len(server.sessions["s"].turns)

    aborted, turns = _serve(gen, tok, body)
    assert len(aborted) == 1 and aborted[0].startswith("s/0/")
    assert turns == 0


def test_hf_generator_streams_through_the_server_with_the_same_trajectory(tmp_path, tok):
    path = build_tiny_model(
        tmp_path,
        TinyModelSpec(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
    )
    gen = HFGenerator(HFGenerator.Config(model_path=str(path)))
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=11)

    async def body(server, oa, an):
        out = []
        for sid, stream in (("a", True), ("b", False)):
            server.open_session(sid, sampling=sp)
            if stream:
                s = await oa.chat.completions.create(
                    model="policy",
                    messages=MESSAGES,
                    stream=True,
                    extra_headers={"X-Session-Id": sid},
                )
                text = "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
            else:
                r = await oa.chat.completions.create(
                    model="policy", messages=MESSAGES, extra_headers={"X-Session-Id": sid}
                )
                text = r.choices[0].message.content or ""
            out.append((text, _rollout(server, sid)))
        return out

    try:
        (t1, r1), (t2, r2) = _serve(gen, tok, body)
    finally:
        asyncio.run(gen.close())
    assert t1 == t2
    assert r1.tokens == r2.tokens and r1.rollout_logprobs == r2.rollout_logprobs


class _NoUpdates:
    """Weight updates that never come (a ResumableGenerator that is never cut)."""

    async def newer_than(self, version: int) -> None:
        await asyncio.Event().wait()

    async def catch_up(self) -> int:
        return 1


def test_streaming_through_a_resumable_generator_still_answers(tok):
    """Partial rollouts wrap the engine in a ResumableGenerator, which does not stream: a
    streamed request gets the whole reply at the end, cut at its stop string as before."""
    from rl_agents.resumable import ResumableGenerator

    wrapped = ResumableGenerator(Gated(tok, TEXT, gated=False), _NoUpdates())
    assert not wrapped.streams_tokens

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        stream = await oa.chat.completions.create(
            model="policy", messages=MESSAGES, stream=True, stop=["one token"]
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return text, server.sessions["s"].turns[0].result.output_ids

    text, out = _serve(wrapped, tok, body)
    assert text == "Hello there, this streams "
    assert tok.decode(list(out)) == "Hello there, this streams one token"  # cut after the stop


OPEN_THINKING_TEMPLATE = (  # ChatML whose generation prompt opens the reasoning (Qwen3-style)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
REASONED = "add 2 and 3, carefully\n</think>\n\nIt is 5, surely."
CALLED = 'add them\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'


def test_reasoning_streams_live_on_every_surface():
    """A prompt that opens the reasoning: the reasoning streams as it is generated (before the
    held last token) as reasoning_content / a thinking block / a reasoning item, then the
    content; each surface assembles what it returns non-streamed; a Responses stream with a
    function call after the reasoning ends with the call."""
    tok = build_tokenizer()
    tok.chat_template = OPEN_THINKING_TEMPLATE
    gen = Gated(tok, REASONED)

    async def body(server, oa, an):
        out = {}
        server.open_session("c", sampling=SAMPLING)
        stream = await oa.chat.completions.create(
            model="policy", messages=MESSAGES, stream=True, extra_headers={"X-Session-Id": "c"}
        )
        got, first = {"reasoning_content": "", "content": ""}, None
        async for c in stream:
            d = c.choices[0].delta.model_dump() if c.choices else {}
            if d.get("reasoning_content") and first is None:
                first = gen.finished
                gen.gate.set()
            for k in got:
                got[k] += d.get(k) or ""
        out["chat"] = (got, first)
        gen.gate.clear()
        server.open_session("a", sampling=SAMPLING)
        first = None
        async with an.messages.stream(
            model="policy", max_tokens=64, messages=MESSAGES, extra_headers={"X-Session-Id": "a"}
        ) as s:
            async for e in s:
                if e.type == "content_block_delta" and first is None:
                    first = gen.finished
                    gen.gate.set()
            out["anthropic"] = (await s.get_final_message(), first)
        gen.gate.clear()
        server.open_session("r", sampling=SAMPLING)
        stream = await oa.responses.create(
            model="policy", input="hi", stream=True, extra_headers={"X-Session-Id": "r"}
        )
        first, events = None, []
        async for e in stream:
            if e.type == "response.reasoning_text.delta" and first is None:
                first = gen.finished
                gen.gate.set()
            events.append(e)
        out["responses"] = (events[-1].response, first)
        gen.gated, gen.text = False, CALLED
        server.open_session("f", sampling=SAMPLING)
        tool = {"type": "function", "name": "add", "parameters": {"type": "object"}}
        stream = await oa.responses.create(
            model="policy",
            input="hi",
            stream=True,
            tools=[tool],
            extra_headers={"X-Session-Id": "f"},
        )
        out["call"] = [e async for e in stream][-1].response
        gen.text = REASONED
        server.open_session("p", sampling=SAMPLING)
        out["plain"] = await oa.chat.completions.create(
            model="policy", messages=MESSAGES, extra_headers={"X-Session-Id": "p"}
        )
        return out

    out = _serve(gen, tok, body)
    plain = out["plain"].choices[0].message.model_dump()
    assert plain["reasoning_content"] == "add 2 and 3, carefully"
    assert plain["content"] == "It is 5, surely."
    got, first = out["chat"]
    assert first == 0 and got == {k: plain[k] for k in got}
    msg, first = out["anthropic"]
    assert first == 1  # the chat request's generation had finished, this one had not
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == plain["reasoning_content"]
    assert msg.content[1].text == plain["content"]
    resp, first = out["responses"]
    assert first == 2
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == plain["reasoning_content"]
    assert resp.output_text == plain["content"]
    call = out["call"]
    assert [o.type for o in call.output] == ["reasoning", "function_call"]
    assert call.output[0].content[0].text == "add them" and call.output[1].name == "add"


def test_long_streams_decode_a_bounded_number_of_times(tok):
    """Streaming a 4000-token completion decodes its text a few hundred times, not once per
    token (each decode is of the whole text), and still sends all of it."""
    from rl_agents.server import _LiveText

    calls = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode("streaming words " * 300, add_special_tokens=False)[:4000]
    sent = []

    async def sink(delta, prompt_tokens, reasoning):
        sent.append(delta)

    async def run():
        live = _LiveText(
            Counting(), sink, prompt_tokens=1, ends=("<tool_call>",), clean=str, holds=()
        )
        for i in ids:
            await live.feed([i])

    asyncio.run(run())
    assert len(calls) < 400
    assert "".join(sent) == tok.decode(ids[:-1]).rstrip()[: len("".join(sent))]
    assert len("".join(sent)) > 0.95 * len(tok.decode(ids))


def test_anthropic_stream_thinking_then_tool_use():
    tok = build_tokenizer()
    tok.chat_template = OPEN_THINKING_TEMPLATE
    gen = Gated(tok, CALLED, gated=False)
    tool = {"name": "add", "input_schema": {"type": "object"}}

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        async with an.messages.stream(
            model="policy", max_tokens=64, messages=MESSAGES, tools=[tool]
        ) as s:
            streamed = await s.get_final_message()
        server.open_session("t", sampling=SAMPLING)
        full = await an.messages.create(
            model="policy",
            max_tokens=64,
            messages=MESSAGES,
            tools=[tool],
            extra_headers={"X-Session-Id": "t"},
        )
        return streamed, full

    streamed, full = _serve(gen, tok, body)
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[0].thinking == full.content[0].thinking == "add them"
    assert streamed.content[1].input == full.content[1].input == {"a": 2}
    assert streamed.stop_reason == full.stop_reason == "tool_use"
