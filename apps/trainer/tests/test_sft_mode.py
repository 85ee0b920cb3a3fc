"""``mode: sft``: chat SFT through rl-train. The loss mask covers exactly the assistant tokens of
a two-turn conversation (hand-checked positions), the loss falls, eval/loss is logged, and a
run stopped at a checkpoint and resumed ends with the same weights as an uninterrupted one."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from rl_core.errors import ConfigError, DataError
from rl_hf.tokenizer import build_tokenizer
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.phases.chat_sft import assistant_tokens


def test_mask_covers_exactly_the_assistant_tokens_of_two_turns() -> None:
    tok = build_tokenizer()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
    ]
    ids, mask = assistant_tokens(messages, tok)
    # the whole conversation, as the template renders it in one go
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    # <|im_start|>user\nhi<|im_end|>\n = 0..9, <|im_start|>assistant\n = 10..20, y o <|im_end|>
    # = 21..23, \n = 24, <|im_start|>user\nab<|im_end|>\n = 25..34, <|im_start|>assistant\n =
    # 35..45, c <|im_end|> = 46..47, \n = 48
    assert len(ids) == 49
    assert [i for i, m in enumerate(mask) if m] == [21, 22, 23, 46, 47]
    assert [ids[i] for i in (21, 22, 23, 46, 47)] == [ord("y"), ord("o"), 258, ord("c"), 258]


def test_conversation_without_assistant_is_refused() -> None:
    with pytest.raises(DataError, match="no assistant message"):
        assistant_tokens([{"role": "user", "content": "hi"}], build_tokenizer())


def _write_chats(path, n: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = ["".join(rng.choice("abcd") for _ in range(rng.randint(2, 3))) for _ in "12"]
            messages = [{"role": "system", "content": "reverse"}]
            for w in words:
                messages += [
                    {"role": "user", "content": w},
                    {"role": "assistant", "content": w[::-1]},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def _source(path: str, shuffle: bool = True) -> dict:
    return {
        "type": "jsonl",
        "path": path,
        "input_key": "messages",
        "label_key": None,
        "apply_chat_template": True,
        "shuffle": shuffle,
    }


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    return _write_chats(d / "train.jsonl", 64, 0), _write_chats(d / "eval.jsonl", 8, 1)


def _recipe(make, run_dir, chat_files, steps: int) -> dict:
    train, held_out = chat_files
    recipe = make(
        run_dir,
        seed=5,
        mode="sft",
        data={"train": _source(train), "eval": _source(held_out, shuffle=False)},
        sft={"steps": steps, "batch_size": 8, "lr": 1e-2},
        eval={"every": 2},
        checkpoint={"every": 2, "keep": 2},
    )
    del recipe["task"], recipe["rollout"], recipe["rl"]
    return recipe


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def _strip(r):
    return {k: v for k, v in r.items() if not k.startswith("perf/")}


def test_sft_mode_learns_logs_eval_loss_and_resumes_exactly(
    tmp_path, tiny_recipe_dict, chat_files
) -> None:
    full = tmp_path / "full"
    records = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, full, chat_files, 4))).run()
    assert {r["phase"] for r in records} == {"sft"}
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    losses = [r["train/loss"] for r in steps]
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.8 * losses[0], (
        losses
    )
    evals = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    assert [s for s, _ in evals] == [0, 2, 4]
    assert evals[-1][1] < 0.8 * evals[0][1], evals
    assert (full / "final_model" / "model.safetensors").is_file()

    # stopped after step 2 (its checkpoint), resumed to 4: same weights and metrics
    part = tmp_path / "part"
    Trainer(load_trainer_config(_recipe(tiny_recipe_dict, part, chat_files, 2))).run()
    resumed = Trainer(
        load_trainer_config(_recipe(tiny_recipe_dict, part, chat_files, 4)), resume=True
    ).run()
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want = [_strip(r) for r in records if r["step"] > 2]
    assert [_strip(r) for r in resumed] == want


def test_sft_mode_config_errors(tiny_recipe_dict, tmp_path, chat_files) -> None:
    recipe = _recipe(tiny_recipe_dict, tmp_path / "r", chat_files, 0)
    with pytest.raises(ConfigError, match="mode: sft"):
        load_trainer_config(recipe)


def test_sft_chat_recipe_loads() -> None:
    from rl_trainer.cli import recipe_path

    cfg = load_trainer_config(recipe_path("sft_chat"))
    assert cfg.mode == "sft" and cfg.sft.steps > 0
    assert cfg.data.train is not None and cfg.data.eval is not None
