"""The environment interface and its built-in loop (:mod:`rl_agents.envs`): exact tokens and
log-probs over multi-turn episodes (a real tiny model, teacher-forced check), sync and async
environments, tool calls, the end reasons, partial rollouts (a turn cut by a weight update
resumes and keeps per-token versions), the per-run concurrency cap, and the errors a user
meets."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence

import pytest
import torch

from rl_agents.envs import Action, Environment, EnvReward, EnvRollout, StepResult
from rl_agents.envs.loop import ENV_GROUP
from rl_agents.resumable import ResumableGenerator
from rl_core import registry
from rl_core.errors import ConfigError, DataError, RewardError
from rl_core.interfaces import Generator, RolloutContext
from rl_core.testing.generator import causal_lm_logprobs
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutStatus,
    SamplingParams,
)
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer
from rl_hf.tiny import TinyModelSpec

NL = 10  # the newline byte of the built-in tokenizer: a model turn ends there


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ------------------------------------------------------------------------------------ envs


class Feedback:
    """Three turns: each turn gets ``<obs k>`` back; the third ends the episode with reward 1
    if the model's text holds an 'a' (anything, for a random model)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.threads: list[str] = []

    def reset(self, prompt: Prompt) -> str:
        self.threads.append(threading.current_thread().name)
        return "[start]\n"

    def step(self, action: Action) -> StepResult:
        self.threads.append(threading.current_thread().name)
        self.actions.append(action)
        if action.turn == 2:
            return StepResult(reward=0.5, done=True, info={"exact": 1.0, "note": "x"})
        return StepResult(observation=f"<obs {action.turn}>\n", reward=0.25)


class AsyncFeedback(Feedback):
    """:class:`Feedback` with ``async`` methods."""

    async def reset(self, prompt: Prompt) -> str:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().reset(prompt)

    async def step(self, action: Action) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().step(action)


class Adder:
    """A tool environment: the model calls ``add`` and then answers; reward 1 for the sum."""

    def reset(self, prompt: Prompt) -> None:
        self.want = prompt.label

    def step(self, action: Action) -> StepResult:
        if action.tool_calls:
            args = json.loads(action.tool_calls[0].arguments)
            return StepResult(observation=f"<result>{args['a'] + args['b']}</result>\n")
        ok = action.text.strip() == f"ANSWER {self.want}"
        return StepResult(reward=float(ok), done=True, info={"exact": float(ok)})


class Slow:
    """Each step waits a little, so episodes overlap unless capped."""

    async def reset(self, prompt: Prompt) -> None:
        return None

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(0.02)
        return StepResult(reward=1.0, done=True)


class RunsCode:
    """Runs the model's turn as Python in the loop's sandbox; its stdout is the observation."""

    sandbox = None

    def reset(self, prompt: Prompt) -> None:
        return None

    async def step(self, action: Action) -> StepResult:
        if action.turn == 1:
            return StepResult(reward=float(action.text.strip() == "42"), done=True)
        run = await self.sandbox.arun(action.text)
        return StepResult(observation=run.stdout, info={"exit_code": run.exit_code})


class Broken(Feedback):
    def step(self, action: Action) -> StepResult:
        raise RuntimeError("tool crashed")


class WrongStep(Feedback):
    def step(self, action: Action) -> StepResult:
        return {"reward": 1.0}  # type: ignore[return-value]


class NoStep:
    def reset(self, prompt: Prompt) -> None:
        return None


for _name, _cls in {
    "t_feedback": Feedback,
    "t_async_feedback": AsyncFeedback,
    "t_adder": Adder,
    "t_slow": Slow,
    "t_code": RunsCode,
    "t_broken": Broken,
    "t_wrong": WrongStep,
    "t_nostep": NoStep,
}.items():
    registry.register(ENV_GROUP, _name, _cls)


# ------------------------------------------------------------------------------- generators


class Scripted(Generator):
    """Returns scripted texts with fixed log-probs; records every request."""

    def __init__(self, tokenizer, texts: Sequence[str], *, delay: float = 0.0) -> None:
        self.tokenizer, self.texts, self.delay = tokenizer, list(texts), delay
        self.requests: list[GenerationRequest] = []

    @property
    def weight_version(self) -> int:
        return 2

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in requests:
            self.requests.append(r)
            if self.delay:
                await asyncio.sleep(self.delay)
            text = self.texts.pop(0) if self.texts else "a\n"
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            cut = len(ids) > r.sampling.max_new_tokens
            ids = ids[: r.sampling.max_new_tokens]
            out.append(
                GenerationResult(
                    request_id=r.request_id,
                    output_ids=ids,
                    output_logprobs=tuple(-0.5 - 0.01 * i for i in range(len(ids))),
                    finish_reason=FinishReason.LENGTH if cut else FinishReason.STOP,
                    weight_version=2,
                )
            )
        return out

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


def _prompt(tok, text: str = "task:", uid: str = "p0", label=None) -> Prompt:
    return Prompt(
        uid=uid,
        input=text,
        token_ids=tuple(tok.encode(text, add_special_tokens=False)),
        label=label,
    )


def _ctx(gen, tok, n: int = 1, **sampling) -> RolloutContext:
    params = {"temperature": 1.0, "max_new_tokens": 8, "stop_token_ids": (NL,), "seed": 5}
    params.update(sampling)
    return RolloutContext(
        generator=gen,
        tokenizer=tok,
        sampling=SamplingParams(**params),
        n_samples=n,
        policy_version=2,
    )


def _keep_envs(fn: EnvRollout) -> list:
    """The environments ``fn`` builds, kept for the test to read."""
    envs: list = []
    factory = fn._factory

    def make():
        envs.append(factory())
        return envs[-1]

    fn._factory = make
    return envs


def _run(env: str, gen, tok, prompt: Prompt, n: int = 1, sampling=None, **options):
    fn = EnvRollout(EnvRollout.Config(env=env, **options))
    return fn, asyncio.run(fn(prompt, _ctx(gen, tok, n, **(sampling or {}))))


# ------------------------------------------------------------------------------------ tests


def test_exact_tokens_and_logprobs_on_a_real_model(tok, tmp_path):
    """Three turns on a tiny real model: the rollout's tokens are the prompt, the reset text,
    then each turn's sampled ids and the environment's observation, exactly (random bytes need
    not survive decode/encode: the sampled ids are kept, never re-encoded); mask 1 exactly on
    the sampled ids; and the recorded log-probs equal the model's teacher-forced
    log-probs over the full multi-turn context."""
    path = build_tiny_model(
        tmp_path,
        TinyModelSpec(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
    )
    gen = HFGenerator(HFGenerator.Config(model_path=str(path), stop_on_eos=False))
    try:
        prompt = _prompt(tok)
        fn = EnvRollout(EnvRollout.Config(env="t_feedback", max_turns=5))
        envs = _keep_envs(fn)
        # every byte is a stop token: turns of 1-6 tokens that end with a stop, as a chat
        # model's turns end with its end-of-turn token
        sampling = {"max_new_tokens": 6, "stop_token_ids": tuple(range(256))}
        (r,) = asyncio.run(fn(prompt, _ctx(gen, tok, **sampling)))
        (env,) = envs
        assert [a.turn for a in env.actions] == [0, 1, 2]
        want, mask = list(prompt.token_ids), []
        start = tok.encode("[start]\n", add_special_tokens=False)
        want += start
        mask += [0] * len(start)
        for a in env.actions:
            want += a.token_ids
            mask += [1] * len(a.token_ids)
            assert a.text == tok.decode(list(a.token_ids), skip_special_tokens=True)
            if a.turn < 2:
                obs = tok.encode(f"<obs {a.turn}>\n", add_special_tokens=False)
                want += obs
                mask += [0] * len(obs)
        assert list(r.tokens) == want
        assert list(r.loss_mask) == mask
        assert r.response_start == len(prompt.token_ids)
        assert r.status == RolloutStatus.COMPLETED
        assert r.metadata["env_reward"] == pytest.approx(1.0)
        assert r.metadata["env_end"] == "done" and r.metadata["env_steps"] == 3
        assert r.metadata["env_info"] == {"exact": 1.0, "note": "x"}
        resp = r.tokens[r.response_start :]
        ref = causal_lm_logprobs(gen.model, prompt.token_ids, resp, 1.0)
        ref_lp = ref.gather(1, torch.tensor(resp)[:, None]).squeeze(1)
        m = torch.tensor(r.loss_mask, dtype=torch.bool)
        got = torch.tensor(r.rollout_logprobs)
        torch.testing.assert_close(got[m], ref_lp[m], atol=1e-4, rtol=0)
        assert torch.all(got[~m] == 0)
        assert EnvReward()(prompt, "", r) == {"reward": pytest.approx(1.0), "exact": 1.0}
    finally:
        asyncio.run(gen.close())


def test_sync_and_async_environments_give_the_same_rollouts(tok):
    """The same scripted model against the sync and the async version of one environment:
    identical rollouts; the sync methods ran on the loop's own daemon threads (not the event
    loop's thread), or inline when asked."""
    texts = ["ab\n", "cd\n", "ef\n"]
    runs = {}
    for env, sync in [("t_feedback", "thread"), ("t_async_feedback", "thread")]:
        fn = EnvRollout(EnvRollout.Config(env=env, sync_env=sync))
        envs = _keep_envs(fn)
        (r,) = asyncio.run(fn(_prompt(tok), _ctx(Scripted(tok, texts), tok)))
        runs[env] = (r, envs[0])
    (rs, es), (ra, ea) = runs["t_feedback"], runs["t_async_feedback"]
    assert rs.tokens == ra.tokens and rs.loss_mask == ra.loss_mask
    assert rs.rollout_logprobs == ra.rollout_logprobs and rs.metadata == ra.metadata
    assert set(es.threads) == {"rl-env"}  # sync env: on daemon threads
    assert set(ea.threads) == {threading.main_thread().name}  # async env: on the loop
    assert rs.versions == (2,) * len(rs.loss_mask)
    fn = EnvRollout(EnvRollout.Config(env="t_feedback", sync_env="inline"))
    (ri,) = asyncio.run(fn(_prompt(tok), _ctx(Scripted(tok, texts), tok)))
    assert ri.tokens == rs.tokens


def test_tool_calls_are_parsed_and_counted(tok):
    """A Hermes ``<tool_call>`` turn reaches the environment as a parsed call, its result comes
    back as observation tokens (mask 0), and the final answer is rewarded."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
    gen = Scripted(tok, [call, "ANSWER 5\n"])
    _, (r,) = _run("t_adder", gen, tok, _prompt(tok, label=5), sampling={"max_new_tokens": 128})
    assert r.metadata["tool_calls"] == 1 and r.metadata["ill_formed_tool_calls"] == 0
    assert r.metadata["env_reward"] == 1.0 and r.metadata["env_end"] == "done"
    resp = tok.decode(list(r.tokens[r.response_start :]))
    assert resp == call + "<result>5</result>\n" + "ANSWER 5\n"
    # text that round-trips: the trajectory is the re-tokenized conversation, id for id
    assert r.tokens == tuple(tok.encode("task:" + resp, add_special_tokens=False))
    obs = tok.encode("<result>5</result>\n", add_special_tokens=False)
    n_call = len(tok.encode(call, add_special_tokens=False))
    assert r.loss_mask == (1,) * n_call + (0,) * len(obs) + (1,) * 9
    # the second request continued from the call and the tool's result
    assert gen.requests[1].input_ids == r.tokens[: r.response_start + n_call + len(obs)]
    # an unparsable block is counted, not called
    gen = Scripted(tok, ["<tool_call>{oops</tool_call>\n", "ANSWER 5\n"])
    _, (r,) = _run("t_adder", gen, tok, _prompt(tok, label=5), sampling={"max_new_tokens": 64})
    assert r.metadata["ill_formed_tool_calls"] == 1 and r.metadata["tool_calls"] == 0
    assert r.metadata["env_reward"] == 0.0  # the env saw no call and took it as the answer


def test_tool_calls_parsed_in_the_configured_family(tok):
    """``tool_format`` picks the family parser: a Mistral ``[TOOL_CALLS]`` turn and a Llama 3
    JSON call reach the environment as calls; under the default (hermes) the same Mistral turn
    is plain text; an unknown family is a ConfigError naming the key."""
    mistral = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}]\n'
    for family, call in (
        ("mistral", mistral),
        ("llama3", '{"name": "add", "parameters": {"a": 2, "b": 3}}\n'),
    ):
        gen = Scripted(tok, [call, "ANSWER 5\n"])
        _, (r,) = _run(
            "t_adder",
            gen,
            tok,
            _prompt(tok, label=5),
            sampling={"max_new_tokens": 128},
            tool_format=family,
        )
        assert r.metadata["tool_calls"] == 1, family
        assert r.metadata["ill_formed_tool_calls"] == 0
        assert r.metadata["env_reward"] == 1.0 and r.metadata["env_end"] == "done"
    gen = Scripted(tok, [mistral, "ANSWER 5\n"])
    _, (r,) = _run("t_adder", gen, tok, _prompt(tok, label=5), sampling={"max_new_tokens": 128})
    assert r.metadata["tool_calls"] == 0 and r.metadata["env_reward"] == 0.0
    with pytest.raises(ConfigError, match="generate_fn.tool_format"):
        EnvRollout.Config(env="t_adder", tool_format="llama")


@pytest.mark.parametrize("family", ["llama3", "mistral", "deepseek", "glm", "kimi_k2"])
def test_each_family_fixture_reaches_the_environment_as_calls(tok, family):
    """The completions each family's own chat template renders (tests/fixtures/
    chat_families.json) reach the environment as the expected calls under that
    ``tool_format``, and as no call under the default."""
    from pathlib import Path

    case = json.loads((Path(__file__).parent / "fixtures" / "chat_families.json").read_text())[
        "families"
    ][family]
    want = [(c["name"], c["arguments"]) for c in case["expected"]["tool_calls"]]
    for fmt, expected in ((family, want), ("hermes", [])):
        # the built-in tokenizer has no stop token in the fixture: a newline ends the turn
        gen = Scripted(tok, [case["completion"] + "\n"])
        # GLM writes arguments as text: the tools' schemas (generate_fn.tools) cast them
        config = EnvRollout.Config(
            env="t_feedback", tool_format=fmt, max_turns=1, tools=case.get("tools")
        )
        fn = EnvRollout(config)
        envs = _keep_envs(fn)
        asyncio.run(fn(_prompt(tok), _ctx(gen, tok, max_new_tokens=512)))
        (action,) = envs[0].actions
        got = [(c.name, json.loads(c.arguments)) for c in action.tool_calls]
        assert got == expected, (fmt, action.text)
        assert fmt == "hermes" or not action.ill_formed_tool_call


def test_end_reasons_max_turns_and_length(tok):
    """An episode the environment never ends stops after ``max_turns`` model turns, or when the
    token budget is full (the last request asked only for what was left)."""
    gen = Scripted(tok, ["ab\n"] * 10)
    _, (r,) = _run("t_feedback", gen, tok, _prompt(tok), max_turns=2)
    assert r.metadata["env_end"] == "max_turns" and r.metadata["model_turns"] == 2
    assert r.metadata["env_reward"] == 0.5  # two steps of 0.25
    # no observation after the last allowed turn: the rollout ends on model tokens
    assert r.loss_mask[-1] == 1
    # 5 prompt + 8 reset + 4 + 8 obs = 25; turn 1 may sample 5 (gets 4) + 8 obs = 37 > 30
    gen = Scripted(tok, ["abc\n"] * 10)
    _, (r,) = _run("t_feedback", gen, tok, _prompt(tok), max_turns=9, max_length=30)
    assert r.metadata["env_end"] == "length" and r.metadata["model_turns"] == 2
    assert len(r.tokens) == 30 and r.status == RolloutStatus.TRUNCATED
    assert [q.sampling.max_new_tokens for q in gen.requests] == [8, 5]
    # a turn cut by max_new_tokens ends the episode after its step
    gen = Scripted(tok, ["abcdefghijk\n"] * 10)
    _, (r,) = _run("t_feedback", gen, tok, _prompt(tok), max_turns=9)
    assert r.metadata["env_end"] == "finish:length" and r.metadata["env_steps"] == 1


def test_environment_errors(tok):
    """An environment that raises fails its rollout (reason recorded), the run goes on; a step
    that returns the wrong type, a class without step(), options for a class without Config and
    EnvReward on a foreign rollout are refused with messages that name the fix."""
    fn, (r,) = _run("t_broken", Scripted(tok, ["ab\n"]), tok, _prompt(tok))
    assert r.status == RolloutStatus.FAILED
    assert "RuntimeError: tool crashed" in r.metadata["failure"]
    assert "step (turn 0)" in r.metadata["failure"] and fn.stats.failed == 1
    with pytest.raises(DataError, match="StepResult"):
        _run("t_wrong", Scripted(tok, ["ab\n"]), tok, _prompt(tok))
    with pytest.raises(ConfigError, match=r"without step\(\)"):
        EnvRollout(EnvRollout.Config(env="t_nostep"))
    with pytest.raises(ConfigError, match="generate_fn.env_options"):
        EnvRollout(EnvRollout.Config(env="t_feedback", env_options={"x": 1}))
    with pytest.raises(ConfigError, match="sync_env"):
        EnvRollout.Config(env="t_feedback", sync_env="pool")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="generate_fn.env"):
        EnvRollout.Config(env="")
    _, (r,) = _run("t_feedback", Scripted(tok, []), tok, _prompt(tok))
    r.metadata.pop("env_reward")
    with pytest.raises(RewardError, match="generate_fn.type: env"):
        EnvReward()(_prompt(tok), "", r)
    assert isinstance(Feedback(), Environment) and isinstance(Slow(), Environment)


def test_concurrency_cap_holds_across_prompts(tok):
    """With ``max_concurrent_episodes: 3``, 4 prompts x 4 samples never run more than 3 episodes
    at once (and do reach 3); without a cap all 16 overlap."""

    async def many(fn: EnvRollout) -> list:
        gen = Scripted(tok, [], delay=0.005)
        return await asyncio.gather(
            *(fn(_prompt(tok, uid=f"p{i}"), _ctx(gen, tok, 4)) for i in range(4))
        )

    capped = EnvRollout(EnvRollout.Config(env="t_slow", max_concurrent_episodes=3))
    out = asyncio.run(many(capped))
    assert sum(len(g) for g in out) == 16
    assert capped.stats.peak_running == 3 and capped.stats.episodes == 16
    assert capped.stats.running == 0
    free = EnvRollout(EnvRollout.Config(env="t_slow"))
    asyncio.run(many(free))
    assert free.stats.peak_running == 16
    # the cap survives a second event loop (the trainer may run phases on new loops)
    asyncio.run(many(capped))
    assert capped.stats.peak_running == 3 and capped.stats.episodes == 32


class Interruptible(Generator):
    """Turn 1's first request samples 'xyz' and then hangs until aborted (a weight update
    lands mid-turn); every other request returns its text at once."""

    supports_abort = True

    def __init__(self, tok) -> None:
        self.tok, self.version = tok, 0
        self.requests: list[GenerationRequest] = []
        self.started = asyncio.Event()
        self.aborted = asyncio.Event()

    @property
    def weight_version(self) -> int:
        return self.version

    def _result(self, r: GenerationRequest, text: str, reason: FinishReason) -> GenerationResult:
        ids = tuple(self.tok.encode(text, add_special_tokens=False))
        return GenerationResult(
            request_id=r.request_id,
            output_ids=ids,
            output_logprobs=(-0.1,) * len(ids),
            finish_reason=reason,
            weight_version=self.version,
        )

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        (r,) = requests
        self.requests.append(r)
        if len(self.requests) == 2:
            self.started.set()
            await self.aborted.wait()
            return [self._result(r, "xyz", FinishReason.ABORT)]
        return [self._result(r, "ok\n" if len(self.requests) < 3 else "w\n", FinishReason.STOP)]

    async def abort(self, request_ids=None) -> None:
        self.aborted.set()

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


class Updates:
    def __init__(self, gen: Interruptible) -> None:
        self.gen, self.released, self.changed = gen, 0, asyncio.Event()

    def release(self) -> None:
        self.released += 1
        self.changed.set()

    async def newer_than(self, version: int) -> None:
        while self.released <= version:
            self.changed.clear()
            await self.changed.wait()

    async def catch_up(self) -> int:
        self.gen.version = self.released
        return self.released


def test_partial_rollouts_resume_a_cut_turn_and_keep_token_versions(tok):
    """Through a ResumableGenerator (what the trainer hands a generate_fn under
    ``rl.partial_rollouts``): turn 1 is cut by a weight update after 'xyz', resumes on version 1
    from prompt + turn 0 + observation + 'xyz', and the rollout keeps every token: turn 0 and
    'xyz' at version 0, the resumed part at version 1; the observation stays mask 0."""

    async def main():
        inner = Interruptible(tok)
        updates = Updates(inner)
        gen = ResumableGenerator(inner, updates)
        fn = EnvRollout(EnvRollout.Config(env="t_feedback", max_turns=2))
        task = asyncio.ensure_future(fn(_prompt(tok), _ctx(gen, tok)))
        await inner.started.wait()
        updates.release()
        (r,) = await task
        return r, inner, gen

    r, inner, gen = asyncio.run(main())
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    p = enc("task:") + enc("[start]\n")
    t0, obs, cut, rest = enc("ok\n"), enc("<obs 0>\n"), enc("xyz"), enc("w\n")
    assert r.tokens == p + t0 + obs + cut + rest
    assert r.loss_mask == (0,) * 8 + (1,) * 3 + (0,) * len(obs) + (1,) * 5
    assert r.versions[8:11] == (0,) * 3 and r.versions[-5:] == (0, 0, 0, 1, 1)
    resumed = inner.requests[2]
    assert resumed.input_ids == p + t0 + obs + cut
    assert resumed.sampling.max_new_tokens == 8 - 3
    assert gen.stats.interruptions == 1 and gen.stats.resumed_tokens == 3
    assert r.metadata["env_steps"] == 2


def test_sandbox_is_given_to_environments_that_ask_for_it(tok):
    """With ``sandbox`` set, the loop's one Sandbox runs the model's code for the environment:
    the first turn's code prints 42 in it, the output comes back as observation tokens and the
    model's second turn is judged; an environment without a ``sandbox`` attribute is refused."""
    fn = EnvRollout(
        EnvRollout.Config(env="t_code", sandbox={"timeout_s": 10, "max_concurrent": 2}, max_turns=2)
    )
    gen = Scripted(tok, ["print(6*7)\n", "42\n"], delay=0.0)
    (r,) = asyncio.run(fn(_prompt(tok), _ctx(gen, tok, max_new_tokens=32)))
    assert "failure" not in r.metadata, r.metadata
    resp = tok.decode(list(r.tokens[r.response_start :]))
    assert resp == "print(6*7)\n" + "42\n" + "42\n"
    assert r.loss_mask == (1,) * 11 + (0,) * 3 + (1,) * 3
    assert r.metadata["env_reward"] == 1.0 and fn.sandbox.peak_running == 1
    with pytest.raises(ConfigError, match="no 'sandbox' attribute"):
        EnvRollout(EnvRollout.Config(env="t_feedback", sandbox={}))
    with pytest.raises(ConfigError, match="generate_fn.sandbox"):
        EnvRollout(EnvRollout.Config(env="t_code", sandbox={"timeout": 1}))
