"""A transformers reward model (sequence classifier) as a batched reward in the trainer."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_buffer.scoring import Scorer
from rl_core import registry
from rl_core.errors import ConfigError
from rl_core.types import Prompt
from rl_hf.reward_model import RewardModel
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer

TINY = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
}


@pytest.fixture(autouse=True)
def _registered():
    """``reward_model`` is rl-hf's entry point; an editable install made before it was added
    does not list it yet, so register it for this process then."""
    if "reward_model" not in registry.available(registry.GROUPS["reward"]):
        registry.register(registry.GROUPS["reward"], "reward_model", RewardModel)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny Qwen2 sequence classifier whose score is known: every attention and MLP output
    projection is zero, so the last position's hidden state is the embedding of the last token
    and the score is ``w . rmsnorm(E[last_token])``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from rl_hf import TinyModelSpec, build_tiny_model

    base = build_tiny_model(tmp_path_factory.mktemp("lm") / "lm", TinyModelSpec(**TINY))
    config = AutoConfig.from_pretrained(str(base), num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.score.weight.copy_(torch.linspace(-1.0, 1.0, config.hidden_size)[None])
    out = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


def _by_hand(rm_dir, text: str) -> float:
    """``w . rmsnorm(E[last token of text])`` from the saved weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    w = load_file(str(rm_dir / "model.safetensors"))
    eps = AutoConfig.from_pretrained(str(rm_dir)).rms_norm_eps
    last = AutoTokenizer.from_pretrained(str(rm_dir))(text)["input_ids"][-1]
    h = w["model.embed_tokens.weight"][last].double()
    h = h * torch.rsqrt(h.pow(2).mean() + eps) * w["model.norm.weight"].double()
    return float(h @ w["score.weight"][0].double())


def test_reward_model_scores_batched_as_computed_by_hand(rm_dir):
    rm = RewardModel(RewardModel.Config(path=str(rm_dir), batch_size=3))
    prompts = [Prompt(uid=str(i), input=f"{'abcde'[: i + 1]}=", token_ids=(1,)) for i in range(5)]
    responses = ["edcba"[: i + 1] for i in range(5)]

    async def score_all():
        return await asyncio.gather(*(rm(p, r) for p, r in zip(prompts, responses, strict=True)))

    got = asyncio.run(score_all())
    want = [_by_hand(rm_dir, p.input + r) for p, r in zip(prompts, responses, strict=True)]
    assert got == pytest.approx(want, abs=1e-4)
    assert len(set(round(x, 4) for x in want)) > 1  # the scores really differ per text
    assert rm.forward_sizes == [3, 2]  # five concurrent calls: one batch, two forwards


def test_trainer_rewards_are_the_reward_model_plus_a_rule_by_weight(
    tmp_path, tiny_recipe_dict, rm_dir, monkeypatch
):
    scored = []
    original = Scorer.score

    async def spy(self, groups, stats):
        await original(self, groups, stats)
        scored.extend(r for g in groups for r in g.rollouts)

    monkeypatch.setattr(Scorer, "score", spy)
    reward = {
        "type": "combine",
        "components": {
            "rm": {"reward": {"type": "reward_model", "path": str(rm_dir)}, "weight": 0.5},
            "rule": {"reward": {"type": "format_match", "pattern": "^[a-c]+$"}, "weight": 2.0},
        },
    }
    recipe = tiny_recipe_dict(tmp_path / "run", seed=1, reward=reward, eval={"every": 0})
    trainer = Trainer(load_trainer_config(recipe))
    records = trainer.run()
    assert len(scored) >= 2 * 2 * 2  # two steps of 2 prompts x 2 samples (+ the eval at step 0)
    tok = trainer.tokenizer
    for r in scored:
        text = tok.decode(list(r.response_ids), skip_special_tokens=True)
        prompt = tok.decode(list(r.tokens[: r.response_start]), skip_special_tokens=True)
        rm = _by_hand(rm_dir, prompt + text)
        assert r.reward_info["rm"] == pytest.approx(rm, abs=1e-4)
        assert r.reward == pytest.approx(0.5 * rm + 2.0 * r.reward_info["rule"], abs=1e-6)
    steps = [x for x in records if x["phase"] == "rl"]
    assert all("rollout/rm_mean" in x for x in steps[1:])


def test_reward_model_config_errors(tmp_path, rm_dir):
    with pytest.raises(ConfigError, match="reward.path"):
        RewardModel(RewardModel.Config(path=str(tmp_path)))
