"""rl-agents: an unmodified OpenAI-client agent talks to the agent server in front of a tiny
model; the server records the exact tokens and log-probs of the conversation as rollouts.

The agent sends two turns (the second re-sends the history plus a new user message, as agents
do); ``finish_session`` turns the recorded turns into one trajectory whose sampled tokens carry
the engine's log-probs (mask 1) and whose template glue and user text are context (mask 0).
Needs the ``test`` extra of rl-agents for the ``openai`` client (any OpenAI-compatible client
works) and rl-hf for the tiny model.

    OMP_NUM_THREADS=1 python examples/agents_server_openai.py
"""

from __future__ import annotations

import asyncio
import tempfile

from openai import AsyncOpenAI

from rl_agents import AgentServer
from rl_core.types import SamplingParams
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer


async def agent(base_url: str, api_key: str) -> None:
    """The agent program: any OpenAI-compatible client; the API key names the session."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": "Say hello."}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "Again, shorter."},
    ]
    await client.chat.completions.create(model="policy", messages=messages)
    await client.close()


async def main(model_dir: str) -> None:
    """Serve the tiny model, run the agent in one session, print the session's rollouts."""
    path = build_tiny_model(model_dir)
    generator = HFGenerator(HFGenerator.Config(model_path=str(path)))
    server = AgentServer(AgentServer.Config(), generator=generator, tokenizer=build_tokenizer())
    await server.start()
    try:
        server.open_session("episode-0", sampling=SamplingParams(max_new_tokens=12))
        await agent(server.base_url, api_key="episode-0")
        rollouts = server.finish_session(
            "episode-0", prompt_uid="task-0", prompt_ids=(), reward=1.0
        )
    finally:
        await server.close()
        await generator.close()
    for r in rollouts:
        sampled = sum(r.loss_mask)
        print(
            f"rollout {r.sample_id}: {len(r.tokens)} tokens, {sampled} sampled (mask 1) with "
            f"log-probs, {r.response_length - sampled} context tokens inside the response, "
            f"reward {r.reward}, turns {r.metadata.get('session_turns')}"
        )
    assert len(rollouts) == 1 and rollouts[0].metadata.get("session_turns") == 2


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(tmp))
