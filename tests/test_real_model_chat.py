"""Real tokenizer, real chat template: SmolLM2-135M-Instruct's BPE tokenizer and ChatML template
through the token-in/token-out paths (the calculator tool rollout, the OpenAI-compatible agent
server) and the chat-message data sources.

A BPE tokenizer does not round-trip: ``encode(decode(ids)) != ids`` for sampled ids (the engine
may pick a tokenization the encoder never produces) and text joined across a turn boundary
merges differently than its parts. The trained ids must be the engine's ids, whatever re-encoding
the rendered conversation would give.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from rl_core.interfaces import Generator, RolloutContext
from rl_core.types import GenerationRequest, GenerationResult, Prompt, SamplingParams
from rl_hf import HFGenerator
from rl_hf.convert import smollm2_135m_instruct

openai = pytest.importorskip("openai")


class Recording(Generator):
    """Delegates to the real HFGenerator and keeps every request and result."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner
        self.requests: list[GenerationRequest] = []
        self.results: list[GenerationResult] = []

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


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_135m_instruct()


@pytest.fixture(scope="module")
def gen(smollm2: Path) -> HFGenerator:
    return HFGenerator(HFGenerator.Config(model_path=str(smollm2), seed=1))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


FEW_SHOT = [
    {
        "role": "system",
        "content": "You have a calculator. Write CALC: followed by the expression on its own "
        "line, read the result, then write ANSWER: and the number.",
    },
    {"role": "user", "content": "What is 3*4?"},
    {"role": "assistant", "content": "CALC: 3*4\n= 12\nANSWER: 12"},
    {"role": "user", "content": "What is 23*47?"},
]


def test_calculator_rollout_keeps_the_engine_ids_across_turns(gen: HFGenerator) -> None:
    """The real model calls the tool (taught by one example in the chat); every trajectory is
    exactly prompt + the engine's ids of each turn + the observation's ids, with the loss mask
    on the engine's tokens only."""
    from rl_agents.examples.calculator import CalculatorRollout

    tok = gen.tokenizer
    rec = Recording(gen)
    ids = tok.apply_chat_template(FEW_SHOT, add_generation_prompt=True, return_dict=False)
    newline = encode(tok, "\n")
    assert newline == [198]
    sampling = SamplingParams(
        temperature=0.7, max_new_tokens=16, stop_token_ids=tuple(newline), seed=3
    )
    ctx = RolloutContext(
        generator=rec, tokenizer=tok, sampling=sampling, n_samples=4, policy_version=0
    )
    prompt = Prompt(uid="p", input=FEW_SHOT, token_ids=tuple(ids))
    rollouts = asyncio.run(
        CalculatorRollout(CalculatorRollout.Config(max_turns=3, max_length=256))(prompt, ctx)
    )
    by_sample: dict[str, list[GenerationResult]] = {}
    for req, res in zip(rec.requests, rec.results):
        by_sample.setdefault(req.request_id.rsplit("/", 1)[0], []).append(res)
    tool_calls = 0
    for r in rollouts:
        assert r.tokens[: r.response_start] == tuple(ids)
        turns = by_sample[r.sample_id]
        pos = r.response_start
        for i, res in enumerate(turns):
            out = res.output_ids
            assert r.tokens[pos : pos + len(out)] == out  # the engine's ids, unchanged
            assert set(r.loss_mask[pos - r.response_start :][: len(out)]) == {1}
            assert r.rollout_logprobs[pos - r.response_start :][: len(out)] == res.output_logprobs
            pos += len(out)
            if i + 1 < len(turns):  # an observation follows: its ids, mask 0
                obs_end = len(r.tokens) - sum(len(t.output_ids) for t in turns[i + 1 :])
                obs = list(r.tokens[pos:obs_end])
                assert tok.decode(obs).startswith("= ")
                assert obs == encode(tok, tok.decode(obs))
                assert set(r.loss_mask[pos - r.response_start : obs_end - r.response_start]) == {0}
                pos = obs_end
        assert pos == len(r.tokens)
        tool_calls += r.metadata["tool_calls"]
    assert tool_calls >= 1
    text = tok.decode(list(rollouts[1].tokens[rollouts[1].response_start :]))
    print(f"\ncalculator trajectories: {tool_calls} tool calls; e.g. {text!r}")
    # A turn boundary the encoder would merge: a model turn that ends in a space (or a blank
    # line) followed by the observation encodes differently as one text than as two parts.
    model_turn, observation = encode(tok, "CALC: 23*47 "), encode(tok, "= 1081\n")
    assert model_turn + observation != encode(tok, "CALC: 23*47 = 1081\n")


def test_agent_server_trains_on_the_served_ids_where_re_encoding_differs(
    gen: HFGenerator,
) -> None:
    """Two-turn chats through the OpenAI-compatible server with the real template: the merged
    rollout is turn 1's prompt + the engine's ids + template glue + turn 2's ids. For some
    samples, encoding the rendered conversation (the template applied to the messages the
    client sent back) gives different ids than the engine's; the rollout keeps the engine's."""
    from rl_agents.server import AgentServer

    tok = gen.tokenizer
    rec = Recording(gen)
    seeds = range(6)

    async def main():
        server = AgentServer(AgentServer.Config(), generator=rec, tokenizer=tok)
        await server.start()
        out = []
        try:
            for s in seeds:
                sid = f"s{s}"
                server.open_session(
                    sid, sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=s)
                )
                async with openai.AsyncOpenAI(
                    base_url=server.base_url, api_key=sid, max_retries=0
                ) as client:
                    conv = [
                        {"role": "system", "content": "Answer in French."},
                        {"role": "user", "content": "Write a word in French."},
                    ]
                    r1 = await client.chat.completions.create(model="policy", messages=conv)
                    conv += [
                        {"role": "assistant", "content": r1.choices[0].message.content or ""},
                        {"role": "user", "content": "Another one."},
                    ]
                    await client.chat.completions.create(model="policy", messages=conv)
                rollouts = server.finish_session(sid, prompt_uid="p", prompt_ids=[1])
                out.append((conv, rollouts))
        finally:
            await server.close()
        return out

    sessions = asyncio.run(main())
    differs = 0
    for k, (conv, rollouts) in enumerate(sessions):
        (merged,) = rollouts
        req1, req2 = rec.requests[2 * k], rec.requests[2 * k + 1]
        out1, out2 = rec.results[2 * k].output_ids, rec.results[2 * k + 1].output_ids
        assert req2.input_ids[: len(req1.input_ids) + len(out1)] == req1.input_ids + out1
        assert merged.tokens == req2.input_ids + out2
        assert merged.response_start == len(req1.input_ids)
        rendered = tok.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
        if list(rendered) + list(out2) != list(merged.tokens):
            differs += 1
    print(f"\nagent server: {differs}/{len(sessions)} conversations re-encode differently")
    assert differs >= 1


def test_chat_message_sources_render_system_prompts_and_template_kwargs(
    smollm2: Path, tmp_path: Path
) -> None:
    """JSONL chat records on the real tokenizer: the default system prompt of the template when
    the record has none, the record's own system prompt otherwise, and template kwargs passed
    through (SmolLM2's template ignores unknown ones; ``add_generation_prompt`` is the source's)."""
    from transformers import AutoTokenizer

    from rl_buffer.sources import JsonlSource

    tok = AutoTokenizer.from_pretrained(smollm2)
    path = tmp_path / "chat.jsonl"
    rows = [
        {"prompt": "What is 2+2?", "label": "4"},
        {
            "prompt": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "What is 2+2?"},
            ],
            "label": "4",
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = JsonlSource(
        JsonlSource.Config(
            path=str(path),
            apply_chat_template=True,
            shuffle=False,
            chat_template_kwargs={"enable_thinking": False},
        ),
        tok,
    )
    plain, system = src.next_prompts(2)
    default_text = tok.decode(list(plain.token_ids))
    assert default_text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(list(system.token_ids)) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Special tokens are single ids (not re-split text), and the ids are the template's own.
    assert plain.token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_dict=False
    )
    assert list(plain.token_ids) == list(expected)
