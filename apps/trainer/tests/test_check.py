"""``rl-train check``: a good recipe passes with its prompts rendered; each kind of broken recipe
fails with the problem named (and the run directory is never written)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from rl_trainer.cli import main

GOOD_REWARD = """
def score(prompt, response, rollout):
    return float(response.strip() == prompt.label)
"""

ROWS = [{"prompt": f"Reverse: {s}", "label": s[::-1]} for s in ("abc", "ba", "cab", "bbca")]


def _write_recipe(
    tmp_path: Path,
    *,
    reward_src: str = GOOD_REWARD,
    train_text: str | None = None,
    extra: str = "",
) -> Path:
    """A tiny recipe with its data and reward file beside it in ``tmp_path``, named by relative
    paths; the reward file gets a unique name (files import under their module name)."""
    module = f"check_reward_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(reward_src)
    lines = "".join(json.dumps(r) + "\n" for r in ROWS)
    (tmp_path / "train.jsonl").write_text(lines if train_text is None else train_text)
    (tmp_path / "eval.jsonl").write_text(lines)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"""
run_dir: {tmp_path / "run"}
model: {{init: {{hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1}}}}
data:
  train: {{type: jsonl, path: train.jsonl, apply_chat_template: true}}
  eval: {{type: jsonl, path: eval.jsonl, apply_chat_template: true}}
reward: {{type: "{module}.py:score"}}
sft: {{steps: 2}}
{extra}
"""
    )
    return recipe


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """``tmp_path``, with the test run from another directory (relative recipe paths must
    resolve against the recipe, not the working directory)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return tmp_path


def _check(recipe: Path, capsys, *args: str) -> tuple[int, str]:
    rc = main(["check", str(recipe), *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_good_recipe_passes_and_shows_the_rendered_prompts(on_path, capsys):
    recipe = _write_recipe(on_path)
    rc, out = _check(recipe, capsys)
    assert rc == 0, out
    # The prompt as the model sees it: the chat template applied (special tokens kept).
    assert "<|im_start|>user" in out and "Reverse: abc<|im_end|>" in out
    assert "<|im_start|>assistant" in out
    assert "check passed" in out and "PROBLEM" not in out
    assert not (on_path / "run").exists(), "check must not write the run directory"


def test_report_scores_dummy_and_label_answers(on_path):
    from rl_trainer.check import DUMMY_RESPONSES, check_recipe

    report = check_recipe(_write_recipe(on_path), rows=2)
    assert not report.findings
    assert [r.set_name for r in report.rows] == ["train", "train", "eval", "eval"]
    for r in report.rows:
        assert r.label is not None and r.label_reward == 1.0
        assert r.dummy_rewards == [0.0] * len(DUMMY_RESPONSES)
        assert r.prompt_text.endswith("<|im_start|>assistant\n")


def test_reward_that_raises_is_a_problem_naming_the_line(on_path, capsys):
    src = "def score(prompt, response, rollout):\n    return 1 / len(response)\n"
    rc, out = _check(_write_recipe(on_path, reward_src=src), capsys)
    assert rc == 1
    assert "ZeroDivisionError" in out and "check_reward_" in out and ".py:2" in out
    assert "check failed" in out


def test_reward_returning_none_is_a_problem(on_path, capsys):
    src = "def score(prompt, response, rollout):\n    return None\n"
    rc, out = _check(_write_recipe(on_path, reward_src=src), capsys)
    assert rc == 1
    assert "returned None (NoneType)" in out and "finite" in out


def test_reward_with_the_wrong_signature_is_a_problem(on_path, capsys):
    src = "def score(response):\n    return 0.0\n"
    rc, out = _check(_write_recipe(on_path, reward_src=src), capsys)
    assert rc == 1
    assert "reward" in out and "takes (response)" in out
    assert "calls it as score(prompt, response, rollout)" in out


def test_bad_data_line_is_a_problem_naming_file_and_line(on_path, capsys):
    text = json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{not json\n"
    rc, out = _check(_write_recipe(on_path, train_text=text), capsys)
    assert rc == 1
    assert "train.jsonl:3" in out and "malformed JSON" in out


def test_missing_data_file_is_a_problem(on_path, capsys):
    recipe = _write_recipe(on_path)
    (on_path / "eval.jsonl").unlink()
    rc, out = _check(recipe, capsys)
    assert rc == 1
    assert "data.eval" in out and str(on_path / "eval.jsonl") in out and "does not" in out


def test_config_error_is_a_problem(on_path, capsys):
    rc, out = _check(_write_recipe(on_path), capsys, "--set", "rollout.n_sample=4")
    assert rc == 1
    assert "n_sample" in out


def test_sft_on_unlabelled_rows_is_a_problem(on_path, capsys):
    text = "".join(json.dumps({"prompt": r["prompt"], "answer": r["label"]}) + "\n" for r in ROWS)
    recipe = _write_recipe(on_path, train_text=text)
    rc, out = _check(recipe, capsys, "--set", "data.train.label_key=null")
    assert rc == 1
    assert "sft.steps" in out and "label" in out


def test_label_scoring_below_threshold_is_a_warning(on_path, capsys):
    src = "def score(prompt, response, rollout):\n    return 0.5\n"
    recipe = _write_recipe(on_path, reward_src=src)
    rc, out = _check(recipe, capsys)
    assert rc == 0, out
    assert "WARNING" in out and "label answer scores below" in out
    rc, _ = _check(recipe, capsys, "--strict")
    assert rc == 1


def test_extra_eval_dataset_uses_its_own_reward(on_path, capsys):
    bad = on_path / f"bad_reward_{uuid.uuid4().hex[:8]}.py"
    bad.write_text("def score(prompt, response, rollout):\n    raise KeyError('x')\n")
    extra = f"""
eval:
  datasets:
    - name: extra
      data: {{type: jsonl, path: eval.jsonl}}
      reward: {{type: "{bad.name}:score"}}
"""
    rc, out = _check(_write_recipe(on_path, extra=extra), capsys)
    assert rc == 1
    assert "eval.datasets[0].reward on eval/extra" in out and "KeyError" in out


def test_bundled_demo_passes(tmp_path):
    """A built-in task: its splits are written to a scratch directory, its reward scores the
    labels 1.0; the run directory stays untouched."""
    from rl_trainer.check import check_recipe
    from rl_trainer.cli import recipe_path

    report = check_recipe(recipe_path("demo"), [f"run_dir={tmp_path / 'run'}"], rows=2)
    assert not report.findings
    assert {r.set_name for r in report.rows} == {"train", "eval"}
    for r in report.rows:  # plain-text prompts "abcd=" (no chat template), label "dcba"
        assert r.prompt_text.endswith("=") and r.label == r.prompt_text[:-1][::-1]
        assert r.label_reward == 1.0
    assert not (tmp_path / "run").exists()


def test_check_tokenizer_is_the_one_the_trainer_loads(tmp_path):
    """``model.init``: check's tokenizer (no weights built) renders prompts exactly like the
    tokenizer the trainer loads from the built ``init_model``."""
    from transformers import AutoTokenizer

    from rl_trainer.build import init_model_path, load_tokenizer
    from rl_trainer.config import load_trainer_config

    cfg = load_trainer_config(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"init": {"hidden_size": 32, "num_layers": 1, "num_heads": 2}},
            "task": {"type": "reverse"},
        }
    )
    checked = load_tokenizer(cfg)
    assert not (tmp_path / "run").exists()
    trained = AutoTokenizer.from_pretrained(init_model_path(cfg))
    messages = [{"role": "user", "content": "Reverse: abc <|im_end|> é"}]
    for tok in (checked, trained):
        assert tok.eos_token_id == trained.eos_token_id
    render = {"tokenize": False, "add_generation_prompt": True}
    assert checked.apply_chat_template(messages, **render) == trained.apply_chat_template(
        messages, **render
    )
    text = trained.apply_chat_template(messages, **render)
    assert checked.encode(text, add_special_tokens=False) == trained.encode(
        text, add_special_tokens=False
    )
