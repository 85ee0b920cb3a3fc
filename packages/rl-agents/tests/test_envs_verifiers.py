"""The verifiers connector (:mod:`rl_agents.envs.verifiers_env`): a verifiers ``SingleTurnEnv``
built on an in-memory dataset runs its own rollout through the agent server (the official
OpenAI client inside verifiers' client), the server records the exact sampled ids and
log-probs, and the environment's rubric gives the session reward."""

from __future__ import annotations

import asyncio

import pytest

vf = pytest.importorskip("verifiers")
datasets = pytest.importorskip("datasets")

from rl_agents.envs.verifiers_env import VerifiersRollout  # noqa: E402
from rl_agents.rollout import SessionReward  # noqa: E402
from rl_core.errors import ConfigError  # noqa: E402
from rl_core.interfaces import RolloutContext  # noqa: E402
from rl_core.types import Prompt, SamplingParams  # noqa: E402
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer  # noqa: E402
from rl_hf.tiny import TinyModelSpec  # noqa: E402

SEEN: list[tuple[str, str]] = []


def _checksum(text: str) -> float:
    return sum((i + 1) * ord(c) for i, c in enumerate(text)) % 9973 / 9973


def load_environment(seen: list) -> object:
    """A SingleTurnEnv on an in-memory dataset with a one-function rubric (a checksum of the
    reply in [0, 1), so each session's reward tells which reply it was) that records what it
    scored in ``seen``."""

    def checksum(completion, answer, **kwargs) -> float:
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        text = text or ""
        seen.append((text, answer))
        return _checksum(text)

    data = datasets.Dataset.from_list([{"question": "abc=", "answer": "cba"}])
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[checksum]))


def test_verifiers_singleturn_env_through_the_agent_server(tmp_path):
    tok = build_tokenizer()
    path = build_tiny_model(
        tmp_path,
        TinyModelSpec(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
    )
    gen = HFGenerator(HFGenerator.Config(model_path=str(path)))
    try:
        fn = VerifiersRollout(
            VerifiersRollout.Config(
                environment=f"{__file__}:load_environment",
                environment_args={"seen": SEEN},
                max_sessions=2,
            )
        )
        text = tok.apply_chat_template(
            [{"role": "user", "content": "abc="}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tuple(tok.encode(text, add_special_tokens=False))
        prompt = Prompt(uid="p0", input="abc=", token_ids=prompt_ids, label="cba")
        ctx = RolloutContext(
            generator=gen,
            tokenizer=tok,
            sampling=SamplingParams(max_new_tokens=6, seed=3),
            n_samples=2,
            policy_version=0,
        )
        SEEN.clear()
        rollouts = asyncio.run(fn(prompt, ctx))
    finally:
        asyncio.run(gen.close())
    assert len(rollouts) == 2 and len(SEEN) == 2
    assert all(answer == "cba" for _, answer in SEEN)  # the prompt's label as the answer
    replies = {_checksum(text): text for text, _ in SEEN}
    assert len(replies) == 2  # two different replies (distinct per-session seeds)
    for r in rollouts:
        assert "failure" not in r.metadata, r.metadata
        # the session's reward is the rubric's score of this session's reply ...
        reward = SessionReward()(prompt, "", r)
        assert reward in replies
        # ... and the rollout holds the chat-rendered prompt, then the ids the engine sampled
        # for that reply (mask 1, the engine's log-probs)
        assert r.tokens[: len(prompt_ids)] == prompt_ids
        sampled = [t for t, m in zip(r.tokens[r.response_start :], r.loss_mask) if m]
        assert tok.decode(sampled, skip_special_tokens=True) == replies[reward]
        assert all(lp < 0 for lp, m in zip(r.rollout_logprobs, r.loss_mask) if m)


def test_verifiers_config_errors():
    with pytest.raises(ConfigError, match="not a verifiers environment"):
        VerifiersRollout(VerifiersRollout.Config(environment="builtins:dict"))
