"""Agent-server fairness and request checks: one 1 MiB chat message does not stall another
session (rendering and tokenizing run off the event loop), a prompt longer than the model's
context is refused with HTTP 400 naming the limit (the model's, not the tokenizer's
``model_max_length``), and a request naming a model the server does not serve gets HTTP 404
naming the served one, on every API surface."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace

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
from rl_hf import build_tokenizer  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
BIG = ("the quick brown fox jumps over the lazy dog 0123456789. " * 20000)[: 1 << 20]


class Echo(Generator):
    """Answers "ok" + EOS at once; ``context`` sets ``max_context_tokens`` (the model's)."""

    def __init__(self, tokenizer, context: int | None = None, hf_context: int | None = None):
        self.tokenizer = tokenizer
        self.prompt_lens: list[int] = []
        if context is not None:
            self.max_context_tokens = context
        if hf_context is not None:  # what HFGenerator exposes
            self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=hf_context))

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        ids = (*self.tokenizer.encode("ok", add_special_tokens=False), self.tokenizer.eos_token_id)
        self.prompt_lens += [len(r.input_ids) for r in requests]
        return [
            GenerationResult(
                request_id=r.request_id,
                output_ids=ids,
                output_logprobs=tuple(-0.5 for _ in ids),
                finish_reason=FinishReason.STOP,
                weight_version=0,
            )
            for r in requests
        ]

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _serve(gen, tok, body, **opts):
    async def main():
        server = AgentServer(AgentServer.Config(**opts), generator=gen, tokenizer=tok)
        await server.start()
        try:
            return await body(server)
        finally:
            await server.close()

    return asyncio.run(main())


def _chat(server, sid: str):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=sid, max_retries=0, timeout=120)


class _Watched:
    """The tokenizer, setting ``started`` when it is asked to encode a long text."""

    def __init__(self, tok) -> None:
        self._tok, self.started = tok, threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, *args, **kwargs):
        if len(text) > 100_000:
            self.started.set()
        return self._tok.encode(text, *args, **kwargs)


def test_a_1mib_message_does_not_stall_another_session(tok):
    """No context limit known: the 1 MiB prompt is rendered and tokenized (seconds of work) in
    a worker thread while another session's request is answered within a second. The clients
    run in their own threads, so the latency is measured off the server's event loop."""
    gen, watched = Echo(tok), _Watched(tok)
    msgs = [{"role": "user", "content": "hi"}]

    async def body(server):
        server.open_session("big", sampling=SAMPLING)
        server.open_session("small", sampling=SAMPLING)

        def client(sid):
            return openai.OpenAI(base_url=server.base_url, api_key=sid, max_retries=0, timeout=120)

        def big():
            with client("big") as c:
                c.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": BIG}]
                )
            return time.monotonic()

        def small():
            assert watched.started.wait(60), "the big prompt was never tokenized"
            with client("small") as c:
                t1 = time.monotonic()
                r = c.chat.completions.create(model="policy", messages=msgs)
                return r, time.monotonic() - t1, time.monotonic()

        return await asyncio.gather(asyncio.to_thread(big), asyncio.to_thread(small))

    big_done, (r, small_latency, small_done) = _serve(gen, watched, body)
    assert r.choices[0].message.content == "ok"
    assert max(gen.prompt_lens) > 1_000_000  # the big prompt really was tokenized
    assert small_latency < 1.0, (small_latency, big_done - small_done)
    assert small_done < big_done  # answered while the big one was still being worked on


class _Wrapper(Generator):
    """A generator wrapping another as ``inner`` (as ResumableGenerator does)."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, requests):
        return await self.inner.generate(requests)

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


@pytest.mark.parametrize("where", ["generator", "hf_model", "wrapped_hf_model", "config"])
def test_prompt_over_the_model_context_is_refused_naming_the_limit(tok, where):
    """The limit comes from the model (not the tokenizer's 1,048,576 ``model_max_length``); a
    1 MiB message is refused before tokenizing it (fast), a slightly long one after."""
    assert tok.model_max_length > 10**6
    opts = {"max_context_tokens": 64} if where == "config" else {}
    gen = Echo(tok, context=64 if where == "generator" else None,
               hf_context=64 if "hf_model" in where else None)  # fmt: skip
    served = _Wrapper(gen) if where.startswith("wrapped") else gen

    async def body(server):
        server.open_session("s", sampling=SAMPLING)
        out = []
        async with _chat(server, "s") as c:
            for text in (BIG, "word " * 80):
                t0 = time.monotonic()
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": text}]
                    )
                out.append((e.value, time.monotonic() - t0))
            ok = await c.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}]
            )
        return server, out, ok

    server, out, ok = _serve(served, tok, body, **opts)
    assert server.max_context_tokens == 64
    for err, _ in out:
        assert err.status_code == 400 and "max_context_tokens=64" in err.message, err.message
        assert err.body["code"] == "context_length_exceeded"
    assert out[0][1] < 1.0  # refused by size, not after seconds of tokenizing
    assert ok.choices[0].message.content == "ok" and gen.prompt_lens  # short ones still served


def test_config_limit_only_lowers_the_model_context(tok):
    async def body(server):
        return server.max_context_tokens

    assert _serve(Echo(tok, context=64), tok, body, max_context_tokens=1000) == 64
    assert _serve(Echo(tok, context=4096), tok, body, max_context_tokens=100) == 100
    assert _serve(Echo(tok), tok, body) is None


def test_unknown_model_names_are_refused_naming_the_served_one(tok):
    msgs = [{"role": "user", "content": "hi"}]

    async def body(server):
        server.open_session("s", sampling=SAMPLING)
        errors = []
        async with _chat(server, "s") as c:
            for call in (
                lambda: c.chat.completions.create(model="gpt-4o", messages=msgs),
                lambda: c.responses.create(model="gpt-4o", input="hi"),
            ):
                with pytest.raises(openai.NotFoundError) as e:
                    await call()
                errors.append(e.value.message)
            served = await c.chat.completions.create(model="policy", messages=msgs)
            alias = await c.chat.completions.create(model="my-agent-model", messages=msgs)
        an = anthropic.AsyncAnthropic(base_url=server.root_url, api_key="s", max_retries=0)
        try:
            with pytest.raises(anthropic.NotFoundError) as e:
                await an.messages.create(model="claude-x", max_tokens=4, messages=msgs)
            errors.append(e.value.message)
        finally:
            await an.close()
        return errors, served, alias

    errors, served, alias = _serve(
        Echo(tok), tok, body, model_name="policy", model_aliases=["my-agent-model"]
    )
    assert len(errors) == 3
    for msg in errors:
        assert "'policy'" in msg and "not served" in msg, msg
    assert served.model == "policy" and alias.choices[0].message.content == "ok"
