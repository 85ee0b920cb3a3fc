"""Shared fixtures of the trainer's in-process tests."""

from __future__ import annotations

from typing import Any

import pytest

TINY_MODEL = {
    "arch": "qwen2",
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
}


@pytest.fixture(scope="session")
def tiny_recipe_dict():
    """A function ``(run_dir, seed, **sections) -> dict``: a tiny reverse-task recipe (one-layer
    model, 4-token responses, no TensorBoard or progress bar); ``sections`` replace or add
    top-level sections."""

    def make(run_dir: Any, seed: int = 0, **sections: Any) -> dict[str, Any]:
        recipe: dict[str, Any] = {
            "run_dir": str(run_dir),
            "seed": seed,
            "model": {"init": dict(TINY_MODEL)},
            "task": {"type": "reverse", "n_train": 64, "n_eval": 6, "min_len": 2, "max_len": 3},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples": 2,
                "sampling": {"temperature": 1.0, "max_new_tokens": 4},
            },
            "rl": {"steps": 2},
            "logging": {"tensorboard": False, "progress": False},
        }
        recipe.update(sections)
        return recipe

    return make


class CharTokenizer:
    """Decodes token ids as the characters with those code points (``ord``/``chr``)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    """A tokenizer whose ids are character code points."""
    return CharTokenizer()


@pytest.fixture
def text_group():
    """A function ``(uid, responses, label="ab") -> Group``: one prompt (token 1) whose rollouts
    respond with the given strings, one token per character (see ``char_tokenizer``)."""
    from rl_core.types import Group, Prompt, Rollout

    def make(uid: str, responses: list[str], label: str | None = "ab") -> Group:
        p = Prompt(uid=uid, input="x", token_ids=(1,), label=label)
        rs = [
            Rollout(
                prompt_uid=uid,
                rollout_id=f"{uid}/{j}",
                sample_id=f"{uid}/{j}",
                tokens=(1, *map(ord, t)),
                response_start=1,
                loss_mask=(1,) * len(t),
                rollout_logprobs=(0.0,) * len(t),
                versions=(0,) * len(t),
            )
            for j, t in enumerate(responses)
        ]
        return Group(prompt=p, rollouts=rs)

    return make
