"""What agents' clients need from the agent server (#33): reasoning through every surface
(returned and recorded), the client's reasoning switch, stop strings, refusal of parameters the
server does not honour, per-request LoRA adapters (``model=<adapter>``, also through a real
HFGenerator with two adapters), model families through the server, and a client disconnect
aborting the generation. Driven with the official ``openai`` and ``anthropic`` clients."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from rl_agents import AgentServer  # noqa: E402
from rl_core.interfaces import Generator  # noqa: E402
from rl_core.lora import SEQUENCE_ADAPTER_KEY  # noqa: E402
from rl_core.types import (  # noqa: E402
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from rl_hf import build_tokenizer  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)
MSGS = [{"role": "user", "content": "2+3?"}]
THINKING_TEMPLATE = (  # ChatML with Qwen3's reasoning switch
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
LLAMA_TEMPLATE = (  # Llama 3 layout; tools rendered as JSON in the system turn
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n{{ tools | tojson }}"
    "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}"
    "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


class Scripted(Generator):
    """Returns scripted texts (encoded, plus EOS unless ``eos`` is off) and keeps requests."""

    supports_abort = True

    def __init__(self, tokenizer, texts, *, eos: bool = True, hang: bool = False) -> None:
        self.tokenizer, self.texts, self.eos, self.hang = tokenizer, list(texts), eos, hang
        self.requests: list[GenerationRequest] = []
        self.results: list[GenerationResult] = []
        self.aborted: list[str] = []
        self._release = asyncio.Event() if hang else None

    @property
    def weight_version(self) -> int:
        return 1

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.requests.extend(requests)
        if self.hang:
            self._release = asyncio.Event()
            await self._release.wait()
        out = []
        for r in requests:
            text = self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            if self.eos:
                ids += (self.tokenizer.eos_token_id,)
            reason = FinishReason.ABORT if r.request_id in self.aborted else FinishReason.STOP
            out.append(
                GenerationResult(
                    request_id=r.request_id,
                    output_ids=ids,
                    output_logprobs=tuple(-0.1 - 0.01 * i for i in range(len(ids))),
                    finish_reason=reason,
                    weight_version=1,
                )
            )
        self.results.extend(out)
        return out

    async def abort(self, request_ids=None) -> None:
        self.aborted.extend(request_ids or [])
        if self._release is not None:
            self._release.set()

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


@pytest.fixture()
def tok():
    return build_tokenizer()


def _serve(gen: Generator, tok, body, **server_opts):
    """Run ``body(server, oa, an)`` on a started server (``oa``/``an``: client per session)."""

    async def main():
        server = AgentServer(AgentServer.Config(**server_opts), generator=gen, tokenizer=tok)
        await server.start()
        clients = []

        def oa(sid):
            clients.append(openai.AsyncOpenAI(base_url=server.base_url, api_key=sid, max_retries=0))
            return clients[-1]

        def an(sid):
            clients.append(
                anthropic.AsyncAnthropic(base_url=server.root_url, api_key=sid, max_retries=0)
            )
            return clients[-1]

        try:
            return await body(server, oa, an)
        finally:
            for c in clients:
                await c.close()
            await server.close()

    return asyncio.run(main())


# ------------------------------------------------------------------------------- reasoning


def test_reasoning_reaches_every_surface_streamed_or_not_and_is_recorded(tok):
    text = "<think>\nadd 2 and 3\n</think>\n\nIt is 5."

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        chat = await oa("s").chat.completions.create(model="policy", messages=MSGS)
        chunks = await oa("s").chat.completions.create(model="policy", messages=MSGS, stream=True)
        streamed = {"reasoning_content": "", "content": ""}
        async for c in chunks:
            d = c.choices[0].delta.model_dump()
            for k in streamed:
                streamed[k] += d.get(k) or ""
        msg = await an("s").messages.create(model="policy", max_tokens=64, messages=MSGS)
        async with an("s").messages.stream(model="policy", max_tokens=64, messages=MSGS) as st:
            msg_streamed = await st.get_final_message()
        resp = await oa("s").responses.create(model="policy", input="2+3?")
        stream = await oa("s").responses.create(model="policy", input="2+3?", stream=True)
        events = [e async for e in stream]
        done = events[-1].response
        assert events[-1].type == "response.completed"
        rollouts = server.finish_session("s", prompt_uid="p", prompt_ids=[1])
        return chat, streamed, msg, msg_streamed, resp, done, rollouts

    gen = Scripted(tok, [text])
    chat, streamed, msg, msg_streamed, resp, done, rollouts = _serve(gen, tok, body)
    m = chat.choices[0].message.model_dump()
    assert m["reasoning_content"] == "add 2 and 3" and m["content"] == "It is 5."
    assert streamed == {"reasoning_content": "add 2 and 3", "content": "It is 5."}
    for message in (msg, msg_streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "add 2 and 3"
        assert message.content[1].text == "It is 5."
    for r in (resp, done):
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "add 2 and 3" and r.output_text == "It is 5."
    # the reasoning tokens are sampled tokens of the trajectory (loss mask 1)
    think_ids = tok.encode("<think>\nadd 2 and 3\n</think>", add_special_tokens=False)
    for r in rollouts:
        resp_ids = list(r.tokens[r.response_start :])
        assert any(resp_ids[i : i + len(think_ids)] == think_ids for i in range(len(resp_ids)))
        assert sum(r.loss_mask) >= len(think_ids)


def test_reasoning_switch_sets_the_template_or_is_refused(tok):
    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        await an("s").messages.create(
            model="policy", max_tokens=8, messages=MSGS, thinking={"type": "disabled"}
        )
        await an("s").messages.create(
            model="policy",
            max_tokens=64,
            messages=MSGS,
            thinking={"type": "enabled", "budget_tokens": 32},
        )
        await oa("s").chat.completions.create(
            model="policy", messages=MSGS, reasoning_effort="minimal"
        )
        await oa("s").responses.create(model="policy", input="2+3?", reasoning={"effort": "high"})

    tok.chat_template = THINKING_TEMPLATE
    gen = Scripted(tok, ["5"])
    _serve(gen, tok, body)
    prompts = [tok.decode(list(r.input_ids)) for r in gen.requests]
    closed = "<think>\n\n</think>\n\n"
    assert [p.endswith(closed) for p in prompts] == [True, False, True, False]

    async def refused(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        with pytest.raises(anthropic.BadRequestError, match="thinking"):
            await an("s").messages.create(
                model="policy",
                max_tokens=64,
                messages=MSGS,
                thinking={"type": "enabled", "budget_tokens": 32},
            )
        with pytest.raises(openai.BadRequestError, match="thinking"):
            await oa("s").chat.completions.create(
                model="policy", messages=MSGS, reasoning_effort="high"
            )

    _serve(Scripted(build_tokenizer(), ["5"]), build_tokenizer(), refused)


# ------------------------------------------------------------------------ stop and refusals


def test_stop_strings_cut_the_tokens_and_the_text(tok):
    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        chat = await oa("s").chat.completions.create(
            model="policy", messages=MSGS, stop=["END", "never"]
        )
        msg = await an("s").messages.create(
            model="policy", max_tokens=64, messages=MSGS, stop_sequences=["END"]
        )
        plain = await oa("s").chat.completions.create(model="policy", messages=MSGS, stop="zzz")
        return chat, msg, plain, list(server.sessions["s"].turns)

    text = "The answer is 5. END and more text"
    chat, msg, plain, turns = _serve(Scripted(tok, [text]), tok, body)
    assert chat.choices[0].message.content == "The answer is 5. "
    assert chat.choices[0].finish_reason == "stop"
    assert msg.content[0].text == "The answer is 5. " and msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == "END"
    assert plain.choices[0].message.content == text
    full = tok.encode(text, add_special_tokens=False)
    for t in turns[:2]:
        out = list(t.result.output_ids)
        # cut right after the token completing "END": the shortest prefix holding it
        assert out == full[: len(out)] and "END" in tok.decode(out)
        assert "END" not in tok.decode(out[:-1])
        assert len(t.result.output_logprobs) == len(out)
        assert t.result.finish_reason == FinishReason.STOP
    assert list(turns[2].result.output_ids) == [*full, tok.eos_token_id]


def test_stop_string_cuts_a_resumed_turn_with_its_pieces(tok):
    """A turn resumed across a weight update (ResumableGenerator's ResumedResult, two pieces of
    different versions) cut by a stop string in its first piece: the pieces are cut with it, so
    every kept token still has the version that sampled it."""
    from rl_agents.resumable import ResumedResult, token_versions

    class Resumed(Scripted):
        async def generate(self, requests):
            (r,) = await super().generate(requests)
            half = 6
            first = dataclasses.replace(
                r,
                output_ids=r.output_ids[:half],
                output_logprobs=r.output_logprobs[:half],
                finish_reason=FinishReason.ABORT,
                weight_version=1,
            )
            second = dataclasses.replace(
                r,
                output_ids=r.output_ids[half:],
                output_logprobs=r.output_logprobs[half:],
                weight_version=2,
            )
            return [ResumedResult.merge([first, second])]

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        chat = await oa("s").chat.completions.create(model="policy", messages=MSGS, stop=["cd"])
        return chat, server.sessions["s"].turns[0].result

    chat, result = _serve(Resumed(tok, ["abcdefghijkl"]), tok, body)
    assert chat.choices[0].message.content == "ab"
    assert tok.decode(list(result.output_ids)) == "abcd"
    assert token_versions(result) == (1,) * len(result.output_ids)
    assert sum(len(p.output_ids) for p in result.pieces) == len(result.output_ids)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 2}, "n"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    ],
)
def test_parameters_not_honoured_are_refused_naming_the_field(tok, kwargs, field):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        with pytest.raises(openai.BadRequestError) as info:
            await oa("s").chat.completions.create(
                model="policy", messages=MSGS, tools=tools, **kwargs
            )
        return info.value

    err = _serve(Scripted(tok, ["x"]), tok, body)
    assert err.body["param"] == field and field in err.message


# --------------------------------------------------------------------------------- adapters


def test_model_names_an_adapter_on_every_surface_and_tags_its_trajectories(tok):
    async def body(server, oa, an):
        models = [m.id async for m in oa("x").models.list()]
        server.open_session("s", sampling=SAMPLING)
        await oa("s").chat.completions.create(model="coder", messages=MSGS)
        await an("s").messages.create(
            model="critic", max_tokens=8, messages=[{"role": "user", "content": "review"}]
        )
        await oa("s").responses.create(model="policy", input="hello")
        with pytest.raises(openai.NotFoundError) as missing:
            await oa("s").chat.completions.create(model="gpt-4o", messages=MSGS)
        # continuing the coder's conversation as the critic would mix adapters in a trajectory
        history = [*MSGS, {"role": "assistant", "content": "5"}, {"role": "user", "content": "?"}]
        with pytest.raises(openai.BadRequestError, match="keep each role"):
            await oa("s").chat.completions.create(model="critic", messages=history)
        await oa("s").chat.completions.create(model="coder", messages=history)
        rollouts = server.finish_session("s", prompt_uid="p", prompt_ids=[1])
        return models, missing.value, rollouts

    gen = Scripted(tok, ["5"])
    models, missing, rollouts = _serve(gen, tok, body, adapters=("coder", "critic"))
    assert models == ["policy", "coder", "critic"]
    assert [r.adapter for r in gen.requests] == ["coder", "critic", None, "coder"]
    assert "'gpt-4o'" in str(missing) and "'coder', 'critic'" in str(missing)
    tags = [r.metadata.get(SEQUENCE_ADAPTER_KEY) for r in rollouts]
    assert tags == ["coder", "critic", None]  # the coder's two turns merged into one
    assert rollouts[0].metadata["session_turns"] == 4


def test_adapters_config_is_checked():
    from rl_core.errors import ConfigError

    with pytest.raises(ConfigError, match="agents.adapters"):
        AgentServer.Config(adapters="coder")
    with pytest.raises(ConfigError, match="name of its own"):
        AgentServer.Config(model_name="coder", adapters=("coder",))


def test_adapter_routing_through_a_real_hf_generator(tmp_path: Path, tok):
    """Two LoRA adapters loaded in one HFGenerator: model=<adapter> samples with that adapter
    (greedy tokens equal the generator's own for that adapter, and differ between the two)."""
    pytest.importorskip("peft")
    from rl_core.lora import LoRAConfig, with_adapter
    from rl_core.testing.policy import random_batch, sft_loss
    from rl_hf import HFGenerator, HFPolicy, build_tiny_model
    from rl_weightsync import InProcessTransport

    base = build_tiny_model(tmp_path / "base")
    gen = HFGenerator(HFGenerator.Config(model_path=str(base), stop_on_eos=False))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)

    async def main():
        for seed, name in enumerate(("coder", "critic")):
            policy = HFPolicy(
                HFPolicy.Config(
                    model_path=str(base), lr=5e-2, seed=seed, lora=LoRAConfig(rank=4, name=name)
                )
            )
            batch = random_batch(policy.model_shape.vocab_size, [9, 6, 11], seed=seed)
            for _ in range(3):
                policy.train_step(batch, sft_loss)
            transport = InProcessTransport(InProcessTransport.Config())
            update = transport.publish(seed + 1, policy.named_adapter_weights())
            await gen.update_weights(with_adapter(update, policy.lora, str(base)), transport)
        server = AgentServer(
            AgentServer.Config(adapters=("coder", "critic")), generator=gen, tokenizer=tok
        )
        await server.start()
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="s", max_retries=0)
        server.open_session("s", sampling=greedy)
        try:
            for name in ("coder", "critic"):
                await client.chat.completions.create(model=name, messages=MSGS)
            turns = list(server.sessions["s"].turns)
            direct = await gen.generate(
                [
                    GenerationRequest(
                        request_id=n, input_ids=turns[0].prompt_ids, sampling=greedy, adapter=n
                    )
                    for n in ("coder", "critic")
                ]
            )
        finally:
            await client.close()
            await server.close()
            await gen.close()
        return turns, direct

    turns, direct = asyncio.run(main())
    served = [list(t.result.output_ids) for t in turns]
    assert served == [list(d.output_ids) for d in direct]
    assert served[0] != served[1]


# ----------------------------------------------------------------------- families, disconnect


def test_llama_family_tool_calls_through_the_server(tok):
    tok.chat_template = LLAMA_TEMPLATE
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def body(server, oa, an):
        assert server.chat.format.name == "llama3"
        server.open_session("s", sampling=SAMPLING)
        chat = await oa("s").chat.completions.create(model="policy", messages=MSGS, tools=tools)
        msg = await an("s").messages.create(
            model="policy",
            max_tokens=64,
            messages=MSGS,
            tools=[{"name": "add", "input_schema": {"type": "object"}}],
        )
        return chat, msg

    text = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    chat, msg = _serve(Scripted(tok, [text]), tok, body)
    call = chat.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert chat.choices[0].finish_reason == "tool_calls"
    assert msg.content[0].type == "tool_use" and msg.content[0].input == {"a": 2, "b": 3}


@pytest.mark.parametrize("abortable", [True, False])
def test_client_disconnect_aborts_the_generation(tok, abortable):
    """A client gone mid-generation: the engine's abort is called (when it has one) and no turn
    is recorded; without abort the result is dropped when it comes."""
    import aiohttp

    async def body(server, oa, an):
        server.open_session("s", sampling=SAMPLING)
        async with aiohttp.ClientSession() as http:
            with pytest.raises(asyncio.TimeoutError):
                await http.post(
                    f"{server.base_url}/chat/completions",
                    json={"model": "policy", "messages": MSGS},
                    headers={"Authorization": "Bearer s"},
                    timeout=aiohttp.ClientTimeout(total=0.5),
                )
        for _ in range(100):  # until the engine returned (aborted, or the slow one finished)
            if gen.results:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        return list(server.sessions["s"].turns)

    gen = Scripted(tok, ["never seen"], hang=True)
    if not abortable:
        gen.supports_abort = False
        gen.hang = False
        gen.generate = _slow(gen.generate)
    turns = _serve(gen, tok, body)
    assert gen.aborted == ([gen.requests[0].request_id] if abortable else [])
    assert len(gen.results) == 1 and turns == []


def _slow(generate):
    async def slow(requests):
        await asyncio.sleep(1.0)
        return await generate(requests)

    return slow


def test_a_reply_sent_back_without_its_reasoning_continues_the_same_trajectory(tok):
    """The client sends the assistant message back as it got it (content with
    reasoning_content, or text with a thinking block): the server renders the model's own text,
    reasoning included, so the next turn extends the same trajectory, on both surfaces."""

    async def body(server, oa, an):
        server.open_session("chat", sampling=SAMPLING)
        server.open_session("anthropic", sampling=SAMPLING)
        r1 = await oa("chat").chat.completions.create(model="policy", messages=MSGS)
        m = r1.choices[0].message.model_dump(exclude_none=True)
        assert "reasoning_content" in m
        history = [*MSGS, m, {"role": "user", "content": "and 3+4?"}]
        await oa("chat").chat.completions.create(model="policy", messages=history)
        m1 = await an("anthropic").messages.create(model="policy", max_tokens=64, messages=MSGS)
        back = {"role": "assistant", "content": [b.model_dump() for b in m1.content]}
        await an("anthropic").messages.create(
            model="policy",
            max_tokens=64,
            messages=[*MSGS, back, {"role": "user", "content": "and 3+4?"}],
        )
        return [
            server.finish_session(sid, prompt_uid="p", prompt_ids=[1])
            for sid in ("chat", "anthropic")
        ]

    sessions = _serve(Scripted(tok, ["<think>\nadd\n</think>\n\nIt is 5."]), tok, body)
    for rollouts in sessions:
        (merged,) = rollouts  # one trajectory: turn 2 extends turn 1's tokens
        assert merged.metadata["session_turns"] == 2
        assert merged.metadata["template_mismatch"] == 0
