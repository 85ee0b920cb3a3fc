"""The reasoning-gym connector (:mod:`rl_agents.envs.reasoning_gym`): the task's splits come
from reasoning-gym's own generator (held-out questions never in training), its reward is the
dataset's own scorer, the environment gives feedback and another attempt, and a wrong dataset
or option is refused naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

rg = pytest.importorskip("reasoning_gym")

from rl_agents.envs import EnvReward, EnvRollout  # noqa: E402
from rl_agents.envs.reasoning_gym import ReasoningGymEnv, ReasoningGymTask  # noqa: E402
from rl_core import registry  # noqa: E402
from rl_core.config import ComponentSpec  # noqa: E402
from rl_core.errors import ConfigError  # noqa: E402
from rl_core.interfaces import Generator, RolloutContext  # noqa: E402
from rl_core.types import (  # noqa: E402
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    SamplingParams,
)
from rl_hf import build_tokenizer  # noqa: E402

OPTS = {"dataset": "spell_backward", "dataset_config": {"min_word_len": 3, "max_word_len": 5}}


def _task(**kw) -> ReasoningGymTask:
    spec = ComponentSpec(
        type="rl_agents.envs.reasoning_gym:ReasoningGymTask", options={**OPTS, **kw}
    )
    return registry.build("task", spec, field="task")


def _prompt(ex: dict, tok, uid: str = "p") -> Prompt:
    return Prompt(
        uid=uid,
        input=ex["prompt"],
        token_ids=tuple(tok.encode(ex["prompt"], add_special_tokens=False)),
        label=ex["label"],
    )


def test_task_splits_and_scorer_are_reasoning_gyms(tmp_path):
    """The splits are reasoning-gym's entries (seed 1234 for train, 1235 for eval) through the
    prompt template; no held-out question is trained on; the reward is the dataset's own
    score_answer on the stripped response."""
    task = _task(n_train=200, n_eval=20)
    paths = task.write_splits(tmp_path)
    rows = {s: [json.loads(x) for x in paths[s].read_text().splitlines()] for s in paths}
    assert len(rows["train"]) == 200 and len(rows["eval"]) == 20
    ev = rg.create_dataset("spell_backward", seed=1235, size=20, **OPTS["dataset_config"])
    assert rows["eval"] == [{"prompt": e["question"] + "\n", "label": e["answer"]} for e in ev]
    assert not {r["prompt"] for r in rows["eval"]} & {r["prompt"] for r in rows["train"]}
    tok = build_tokenizer()
    ex = rows["eval"][0]
    entry = ev[0]
    p = _prompt(ex, tok)
    assert task(p, f"  {ex['label']}\n", None) == {"reward": 1.0, "exact": 1.0}
    wrong = ex["label"][:2] + "zz"
    got = task(p, wrong, None)
    assert got["reward"] == ev.score_answer(wrong, entry) and got["exact"] == 0.0
    assert 0.0 < got["reward"] < 1.0  # partial credit from the dataset's scorer
    # reasoning-gym's <answer> extraction, when asked for
    tagged = _task(n_train=200, n_eval=20, answer_format="answer_tag")
    assert tagged(p, f"think... <answer>{ex['label']}</answer>", None)["reward"] == 1.0
    assert tagged(p, ex["label"], None)["reward"] == 0.0  # no tag: no answer


def test_task_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="no dataset 'spell_backwards'"):
        _task(dataset="spell_backwards")
    with pytest.raises(ConfigError, match="task.dataset_config"):
        _task(dataset_config={"word_len": 3})
    with pytest.raises(ConfigError, match="prompt_template"):
        _task(prompt_template="no question here")
    with pytest.raises(ConfigError, match="generate_fn.env_options.dataset: reasoning-gym has"):
        ReasoningGymEnv.Config(dataset="spell_backwards")


class Answers(Generator):
    """Answers each request with the next scripted text (plus EOS)."""

    def __init__(self, tok, texts: Sequence[str]) -> None:
        self.tok, self.texts = tok, list(texts)
        self.inputs: list[str] = []

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        (r,) = requests
        self.inputs.append(self.tok.decode(list(r.input_ids)))
        ids = tuple(self.tok.encode(self.texts.pop(0), add_special_tokens=False))
        ids += (self.tok.eos_token_id,)
        return [
            GenerationResult(
                request_id=r.request_id,
                output_ids=ids,
                output_logprobs=(-0.3,) * len(ids),
                finish_reason=FinishReason.STOP,
                weight_version=0,
            )
        ]

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


def test_environment_gives_feedback_and_a_second_attempt():
    """Through the built-in loop: a wrong first attempt gets the feedback text (mask 0) and a
    second turn; the reward is the second attempt's score from the dataset's scorer. A right
    first attempt ends at once."""
    tok = build_tokenizer()
    task = _task(n_train=50, n_eval=8)
    ex = task.examples("eval")[3]
    fn = EnvRollout(
        EnvRollout.Config(
            env="rl_agents.envs.reasoning_gym:ReasoningGymEnv",
            env_options={**OPTS, "n_train": 50, "n_eval": 8, "max_attempts": 2},
            max_turns=3,
        )
    )
    ctx = lambda gen: RolloutContext(  # noqa: E731
        generator=gen,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=16),
        n_samples=1,
        policy_version=0,
    )
    ds = rg.create_dataset("spell_backward", seed=1235, size=8, **OPTS["dataset_config"])
    gen = Answers(tok, ["xyz", ex["label"]])
    (r,) = asyncio.run(fn(_prompt(ex, tok), ctx(gen)))
    assert r.metadata["env_reward"] == 1.0 and r.metadata["env_steps"] == 2
    feedback = ReasoningGymEnv.Config(**OPTS).feedback
    assert gen.inputs[1] == ex["prompt"] + "xyz" + tok.eos_token + feedback
    first = ds.score_answer("xyz", ds[3])
    assert EnvReward()(_prompt(ex, tok), "", r) == {
        "reward": 1.0,
        "exact": 1.0,
        "attempts": 2.0,
        "first_attempt": first,
    }
    n_fb = len(tok.encode(feedback, add_special_tokens=False))
    assert r.loss_mask == (1,) * 4 + (0,) * n_fb + (1,) * (len(ex["label"]) + 1)
    # both wrong: the best attempt's partial score (default) or the last one's
    better, worse = ex["label"][:2] + "q", "q"
    assert ds.score_answer(better, ds[3]) > ds.score_answer(worse, ds[3])
    gen = Answers(tok, [better, worse])
    (r,) = asyncio.run(fn(_prompt(ex, tok), ctx(gen)))
    assert r.metadata["env_reward"] == ds.score_answer(better, ds[3])
    assert r.metadata["env_end"] == "done" and r.metadata["env_info"]["exact"] == 0.0
    last = EnvRollout(
        EnvRollout.Config(
            env="rl_agents.envs.reasoning_gym:ReasoningGymEnv",
            env_options={**OPTS, "n_train": 50, "n_eval": 8, "reward": "last"},
            max_turns=3,
        )
    )
    (r,) = asyncio.run(last(_prompt(ex, tok), ctx(Answers(tok, [better, worse]))))
    assert r.metadata["env_reward"] == ds.score_answer(worse, ds[3])
    gen = Answers(tok, [ex["label"]])
    (r,) = asyncio.run(fn(_prompt(ex, tok), ctx(gen)))
    assert r.metadata["env_reward"] == 1.0 and r.metadata["env_steps"] == 1
