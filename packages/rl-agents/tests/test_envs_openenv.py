"""The OpenEnv connector (:mod:`rl_agents.envs.openenv_env`): an OpenEnv environment served by
OpenEnv's own server in this process and driven through its WebSocket client by the built-in
loop: rewards and observations come from the environment, a tool call becomes a structured
action, a running server is reached by URL, and mistakes are refused naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

pytest.importorskip("openenv.core")

from rl_agents.envs import EnvReward, EnvRollout
from rl_agents.envs.openenv_env import OpenEnvEnv, serve_app
from rl_core.errors import ConfigError, DataError
from rl_core.interfaces import Generator, RolloutContext
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    SamplingParams,
)
from rl_hf import build_tokenizer

APP = "rl_agents.envs.openenv_reverse:app"


class Answers(Generator):
    """Answers each request with the next scripted text (plus EOS)."""

    def __init__(self, tok, texts: Sequence[str]) -> None:
        self.tok, self.texts = tok, list(texts)
        self.inputs: list[str] = []

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in requests:
            self.inputs.append(self.tok.decode(list(r.input_ids)))
            ids = tuple(self.tok.encode(self.texts.pop(0), add_special_tokens=False))
            ids += (self.tok.eos_token_id,)
            out.append(
                GenerationResult(
                    request_id=r.request_id,
                    output_ids=ids,
                    output_logprobs=(-0.2,) * len(ids),
                    finish_reason=FinishReason.STOP,
                    weight_version=0,
                )
            )
        return out

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _episodes(tok, texts, n=1, max_turns=1, **options):
    fn = EnvRollout(
        EnvRollout.Config(
            env="rl_agents.envs.openenv_env:OpenEnvEnv",
            env_options={"label_reset_key": "target", **options},
            max_turns=max_turns,
        )
    )
    gen = Answers(tok, texts)
    ctx = RolloutContext(
        generator=gen,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=128),
        n_samples=n,
        policy_version=0,
    )
    prompt = Prompt(
        uid="p",
        input="abcd=",
        token_ids=tuple(tok.encode("abcd=", add_special_tokens=False)),
        label="dcba",
    )
    return asyncio.run(fn(prompt, ctx)), gen, fn


def test_episodes_through_openenvs_server_and_client(tok):
    """Two sessions at once against OpenEnv's server: each gets the environment's reward
    (position match against the reset target) and its observation fields as reward
    components; a session with two attempts gets the first answer's feedback as mask-0 tokens
    before its second turn."""
    rollouts, _, fn = _episodes(tok, ["dcba", "dcxx"], n=2, app=APP)
    assert fn.stats.failed == 0
    # the sessions run concurrently: whichever asks first gets the first scripted answer
    bad, good = sorted(rollouts, key=lambda r: r.metadata["env_reward"])
    assert good.metadata["env_reward"] == 1.0 and good.metadata["env_done"] is True
    assert bad.metadata["env_reward"] == 0.5 and bad.metadata["env_info"]["feedback"] == "2 right"
    assert EnvReward()(None, "", bad) == {"reward": 0.5, "score": 0.5, "exact": 0.0}
    (r,), gen, _ = _episodes(
        tok,
        ["dcbx", "dcba"],
        max_turns=3,
        app=APP,
        reset_kwargs={"max_attempts": 2},
        observation_template=" {feedback}\n",
    )
    assert gen.inputs[1] == "abcd=dcbx" + tok.eos_token + " 3 right\n"
    assert r.metadata["env_steps"] == 2 and r.metadata["env_reward"] == pytest.approx(0.75 + 1.0)
    n_obs = len(tok.encode(" 3 right\n", add_special_tokens=False))
    assert r.loss_mask == (1,) * 5 + (0,) * n_obs + (1,) * 5


def test_tool_call_becomes_the_action_and_base_url_reaches_a_running_server(tok):
    """A ``<tool_call>`` turn sends its JSON arguments as the action's fields; ``base_url``
    talks to a server that is already running (the one the test started)."""
    call = '<tool_call>{"name": "answer", "arguments": {"message": "dcba"}}</tool_call>'
    (r,), _, _ = _episodes(tok, [call], base_url=serve_app(APP))
    assert r.metadata["tool_calls"] == 1 and r.metadata["env_reward"] == 1.0
    (r,), _, _ = _episodes(tok, ["dcba"], base_url=serve_app(APP), tool_call_actions=False)
    assert r.metadata["env_reward"] == 1.0


def test_openenv_mistakes_are_refused_naming_the_field(tok):
    with pytest.raises(ConfigError, match="exactly one of base_url"):
        OpenEnvEnv.Config()
    with pytest.raises(ConfigError, match="exactly one of base_url"):
        OpenEnvEnv.Config(app=APP, base_url="http://127.0.0.1:1")
    with pytest.raises(DataError, match=r"observation_template.*'nope'.*feedback"):
        _episodes(
            tok,
            ["dcbx", "dcba"],
            max_turns=2,
            app=APP,
            reset_kwargs={"max_attempts": 2},
            observation_template="{nope}",
        )
