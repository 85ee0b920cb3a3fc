"""Operating a run: rollout dumps, `rl-train replay` (bitwise the same weights), `rl-train
rollout`, `rl-train eval`, sample traces and `rl-train show`, report panels and comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_core.errors import ConfigError, DataError
from rl_core.types import Group, Prompt, Rollout, RolloutStatus
from rl_trainer.cli import main
from rl_trainer.ops import dumps

REWARD = """
def reward(prompt, response, rollout):
    # varied within a group, so advantages and updates are not zero
    return (sum(map(ord, response)) % 7) / 6
"""


@pytest.fixture(scope="module")
def dumped_run(tmp_path_factory, tiny_recipe_dict):
    """A 2-step run with dumps, sample traces every step and TensorBoard; returns its dir."""
    root = tmp_path_factory.mktemp("dumped")
    (root / "reward.py").write_text(REWARD)
    recipe = tiny_recipe_dict(
        root / "run",
        reward={"type": f"{root / 'reward.py'}:reward"},
        policy={"type": "hf", "lr": 0.01},
        logging={"tensorboard": True, "progress": False, "samples_every": 1},
    )
    recipe["rollout"]["dump_dir"] = str(root / "run" / "dumps")
    (root / "recipe.json").write_text(json.dumps(recipe))
    assert main(["run", str(root / "recipe.json"), "--no-report"]) == 0
    return root / "run"


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_dump_holds_every_step_and_round_trips(dumped_run):
    d = dumped_run / "dumps"
    assert dumps.dumped_steps(d) == [1, 2]
    manifest = dumps.read_manifest(d)
    assert manifest["version"] == dumps.FORMAT_VERSION and manifest["config"]["rl"]["steps"] == 2
    step = dumps.load_step(d, 2)
    assert step.header["policy_version"] == 1 and len(step.groups) == 2
    assert "rollout/reward_mean" in step.round_metrics
    assert step.staleness["rollout/staleness_mean"] == 0.0
    for g, advs in zip(step.groups, step.advantages):
        assert len(g.rollouts) == 2
        for r, adv in zip(g.rollouts, advs):
            assert len(adv) == len(r.loss_mask) == len(r.rollout_logprobs) == r.response_length
            assert r.versions == (1,) * r.response_length
            assert r.reward is not None and "reward" in r.reward_info
        rewards = [r.reward for r in g.rollouts]
        if rewards[0] != rewards[1]:  # GRPO: the better rollout gets the positive advantage
            best = rewards.index(max(rewards))
            assert advs[best][0] > 0 > advs[1 - best][0]
    # The trained-on rollouts are those the metrics counted.
    records = [json.loads(x) for x in (dumped_run / "metrics.jsonl").read_text().splitlines()]
    assert records[2]["rollout/reward_mean"] == step.round_metrics["rollout/reward_mean"]


def test_routing_round_trips_with_its_dtype(tmp_path):
    prompt = Prompt(uid="p", input="x", token_ids=(1, 2), label={"a": [1]})
    routed = torch.randint(0, 200, (5, 3, 2), dtype=torch.uint8)
    r = Rollout(
        prompt_uid="p",
        rollout_id="p/0",
        sample_id="p/0",
        tokens=(1, 2, 3, 4, 5),
        response_start=2,
        loss_mask=(1, 0, 1),
        rollout_logprobs=(-0.1, 0.0, -1 / 3),
        versions=(4, 4, 5),
        status=RolloutStatus.TRUNCATED,
        reward=0.5,
        reward_info={"reward": 0.5, "fmt": 1.0},
        routed_experts=routed,
    )
    dumps.write_manifest(tmp_path, {})
    dumps.write_step(tmp_path, 7, [Group(prompt=prompt, rollouts=[r])], advantages=[[None]])
    back = dumps.load_step(tmp_path, 7).groups[0]
    r2 = back.rollouts[0]
    assert r2.routed_experts.dtype == torch.uint8 and torch.equal(r2.routed_experts, routed)
    assert r2.rollout_logprobs == r.rollout_logprobs  # exact floats
    assert (r2.status, r2.versions, r2.reward_info) == (r.status, r.versions, r.reward_info)
    assert back.prompt.label == {"a": [1]}
    with pytest.raises(DataError, match="step_000008.jsonl: not found.*steps 7..7"):
        dumps.load_step(tmp_path, 8)


def test_dump_refuses_unserialisable_labels_and_foreign_versions(tmp_path):
    prompt = Prompt(uid="p", input="x", token_ids=(1,), label=object())
    with pytest.raises(DataError, match="rollout.dump_dir: step 1, prompt p holds a object"):
        dumps.write_step(tmp_path, 1, [Group(prompt=prompt, rollouts=[])])
    (tmp_path / "dump.json").write_text(json.dumps({"format": dumps.FORMAT, "version": 99}))
    with pytest.raises(DataError, match="version 99"):
        dumps.read_manifest(tmp_path)


def test_replay_gives_bitwise_the_same_weights(dumped_run, tmp_path):
    out = tmp_path / "replayed"
    recipe = str(dumped_run.parent / "recipe.json")  # the dump names code: replay needs it
    assert main(["replay", str(dumped_run / "dumps"), recipe, "--set", f"run_dir={out}"]) == 0
    original, replayed = _weights(dumped_run / "final_model"), _weights(out / "final_model")
    init = _weights(dumped_run / "init_model")
    assert original.keys() == replayed.keys()
    assert any(not torch.equal(original[k], init[k]) for k in original)  # training moved them
    for k in original:
        assert torch.equal(original[k], replayed[k]), k
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    orig = [json.loads(x) for x in (dumped_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in records if r["step"]] == [
        r["train/loss"] for r in orig if r["step"]
    ]


def test_replay_of_an_async_run_is_bitwise_too(tmp_path, tiny_recipe_dict):
    """Async generation (rounds one version stale) and sample traces in the original run;
    the replay trains synchronously on the dumped groups and ends on the same weights."""
    # Its own module name: the module-scoped run above already imported a "reward" module.
    (tmp_path / "async_reward.py").write_text(REWARD)
    recipe = tiny_recipe_dict(
        tmp_path / "run",
        reward={"type": f"{tmp_path / 'async_reward.py'}:reward"},
        policy={"type": "hf", "lr": 0.01},
        rl={"steps": 3, "async_generation": True, "max_staleness": 1},
        logging={"tensorboard": False, "progress": False, "samples_every": 1},
    )
    recipe["rollout"]["dump_dir"] = str(tmp_path / "run" / "dumps")
    (tmp_path / "r.json").write_text(json.dumps(recipe))
    assert main(["run", str(tmp_path / "r.json"), "--no-report"]) == 0
    stale = [dumps.load_step(tmp_path / "run" / "dumps", s).staleness for s in (1, 2, 3)]
    assert [x["rollout/staleness_max"] for x in stale] == [0, 1, 1]
    out = tmp_path / "replayed"
    dump, recipe = str(tmp_path / "run" / "dumps"), str(tmp_path / "r.json")
    assert main(["replay", dump, recipe, "--set", f"run_dir={out}"]) == 0
    original, replayed = _weights(tmp_path / "run" / "final_model"), _weights(out / "final_model")
    assert all(torch.equal(original[k], replayed[k]) for k in original)


def test_replay_errors_name_the_fix(dumped_run, tmp_path, capsys):
    assert main(["replay", str(tmp_path)]) == 2
    assert "dump.json: not found" in capsys.readouterr().err
    from rl_trainer.ops.replay import run_replay

    with pytest.raises(ConfigError, match="rl.steps: 3, but .* holds 2 dumped steps"):
        run_replay(
            dumped_run / "dumps",
            dumped_run.parent / "recipe.json",
            ["rl.steps=3", f"run_dir={tmp_path / 'x'}"],
        )


def test_rollout_only_generates_scores_and_dumps(tmp_path, tiny_recipe_dict):
    recipe = tiny_recipe_dict(
        tmp_path / "gen",
        rl={"steps": 2},
        logging={"tensorboard": False, "progress": False, "samples_every": 2},
    )
    recipe["rollout"]["dump_dir"] = str(tmp_path / "gen" / "dumps")
    (tmp_path / "r.json").write_text(json.dumps(recipe))
    assert main(["rollout", str(tmp_path / "r.json")]) == 0
    assert dumps.dumped_steps(tmp_path / "gen" / "dumps") == [1, 2]
    step = dumps.load_step(tmp_path / "gen" / "dumps", 2)
    assert step.header["policy_version"] == 0
    assert all(v == 0 for g in step.groups for r in g.rollouts for v in r.versions)
    records = [json.loads(x) for x in (tmp_path / "gen" / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == ["rollout", "rollout"]
    assert all("train/loss" not in r for r in records)
    assert not (tmp_path / "gen" / "final_model").exists()
    from rl_trainer.ops.samples import read_samples

    (line, _) = read_samples(tmp_path / "gen")  # no policy: traces without trainer log-probs
    assert line["step"] == 2 and line["rollouts"][0]["trainer_logprobs"] is None
    assert line["rollouts"][0]["reward"] is not None


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_reproduces_the_runs_own_evaluations(dumped_run, capsys):
    """Eval-only on the initial model gives the run's step-0 eval; on the last checkpoint it
    gives the run's last eval (greedy eval: the same answers)."""
    orig = [r for r in _records(dumped_run) if "eval/reward_mean" in r]
    recipe = str(dumped_run.parent / "recipe.json")  # its config names code: pass the recipe
    assert main(["eval", str(dumped_run / "init_model"), recipe]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    first = {k: v for k, v in orig[0].items() if k.startswith("eval/")}
    assert summary["metrics"] == first
    saved = json.loads(Path(summary["out"]).read_text())
    assert saved["metrics"] == first and saved["config"]["model"]["path"].endswith("init_model")
    ckpt = next((dumped_run / "checkpoints").iterdir())
    assert main(["eval", str(ckpt), recipe]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 2
    assert summary["metrics"] == {k: v for k, v in orig[-1].items() if k.startswith("eval/")}
    eval_dir = dumped_run / "eval" / ckpt.name
    assert Path(summary["out"]) == eval_dir / "eval.json"
    (rec,) = _records(eval_dir)  # the metrics sink got the record too
    assert (
        rec["phase"] == "eval" and rec["eval/reward_mean"] == summary["metrics"]["eval/reward_mean"]
    )


def test_eval_errors_name_the_fix(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert "not a directory; pass a run's final_model" in capsys.readouterr().err
    (tmp_path / "model").mkdir()
    assert main(["eval", str(tmp_path / "model")]) == 2
    assert "pass the recipe: rl-train eval CHECKPOINT RECIPE" in capsys.readouterr().err


def test_wandb_sink_without_the_package_names_the_fix(monkeypatch, tmp_path, tiny_recipe_dict):
    import sys

    from rl_trainer.config import load_trainer_config
    from rl_trainer.ops.sinks import build_sinks

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_trainer_config(
        tiny_recipe_dict(tmp_path, logging={"wandb": {"mode": "offline"}, "progress": False})
    )
    with pytest.raises(
        ConfigError, match=r"logging.wandb: .*pip install 'rlpost-trainer\[wandb\]'"
    ):
        build_sinks(cfg)


def test_sample_traces_match_the_dump_and_reach_tensorboard(dumped_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rl_trainer.ops.samples import read_samples

    lines = read_samples(dumped_run)
    assert sorted({line["step"] for line in lines}) == [1, 2]
    for line in read_samples(dumped_run, step=2):
        dumped = dumps.load_step(dumped_run / "dumps", 2)
        (i,) = [i for i, g in enumerate(dumped.groups) if g.prompt.uid == line["prompt_uid"]]
        for r, rd, adv in zip(line["rollouts"], dumped.groups[i].rollouts, dumped.advantages[i]):
            assert r["reward"] == rd.reward and r["advantage"] == pytest.approx(adv[0])
            assert r["rollout_logprobs"] == list(rd.rollout_logprobs)
            assert len(r["trainer_logprobs"]) == len(r["tokens"]) == rd.response_length
            # On-policy, same weights in the engine and the trainer: numerics only.
            assert r["mismatch_max"] < 1e-3
    assert len(read_samples(dumped_run, step=1)) == 2  # logging.samples_groups default
    ea = EventAccumulator(str(dumped_run / "tb"), size_guidance={"tensors": 0})
    ea.Reload()
    assert "samples/text_summary" in ea.Tags()["tensors"]
    assert [e.step for e in ea.Tensors("samples/text_summary")] == [1, 2]


def test_show_prints_a_step_readably(dumped_run, capsys):
    import io

    from rich.console import Console

    from rl_trainer.ops.samples import read_samples
    from rl_trainer.show import show_samples

    buf = io.StringIO()
    assert show_samples(dumped_run, step=1, tokens=True, console=Console(file=buf, width=160)) == 1
    text = buf.getvalue()
    for line in read_samples(dumped_run, step=1):
        assert f"prompt  {line['prompt']}" in text and f"label   {line['label']}" in text
        assert text.count("rollout 0: tokens") == 2
    assert "trainer logp" in text and "max |mismatch|" in text
    assert main(["show", str(dumped_run), "--step", "9"]) == 2
    assert "no trace of step 9; traced steps: 1, 2" in capsys.readouterr().err


def test_report_has_step_time_staleness_and_mismatch_panels(dumped_run):
    from rl_trainer.ops.metrics import read_metrics
    from rl_trainer.ops.report import STEP_TIME, build_figure, write_report

    records = read_metrics(dumped_run)
    fig = build_figure({"run": records})
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    step_time = axes["Step time (s)"]
    labels = step_time.get_legend_handles_labels()[1]
    assert labels == [label for _, label in STEP_TIME] + ["step total"]
    # The stack's top equals the parts' sum at each RL step.
    (stack_top,) = [c for c in step_time.collections][-1:]
    rl = [r for r in records if r["phase"] == "rl" and r["step"]]
    # Each RL step also reports this process's CPU seconds (benchmarks' CPU-s/sample).
    assert all(0 < r["perf/step_cpu_s"] < 10 * r["perf/step_time"] + 1 for r in rl)
    tops = stack_top.get_paths()[0].vertices[:, 1].max()
    assert tops == pytest.approx(
        max(sum(r.get(k) or 0.0 for k, _ in STEP_TIME) for r in rl), rel=1e-6
    )
    assert "rollout/staleness_mean" in axes["Staleness (versions)"].get_legend_handles_labels()[1]
    assert "train/mismatch" in axes["Log-prob mismatch"].get_legend_handles_labels()[1]
    assert write_report(dumped_run).stat().st_size > 10_000


def test_report_compares_two_runs_on_one_figure(dumped_run, tmp_path, capsys):
    import shutil

    from rl_trainer.ops.metrics import read_metrics
    from rl_trainer.ops.report import build_figure

    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(dumped_run / "metrics.jsonl", other / "metrics.jsonl")
    fig = build_figure({"run": read_metrics(dumped_run), "other": read_metrics(other)})
    reward = next(ax for ax in fig.axes if ax.get_title() == "Reward")
    labels = reward.get_legend_handles_labels()[1]
    assert "run: rollout/reward_mean" in labels and "other: rollout/reward_mean" in labels
    colors = {line.get_label(): line.get_color() for line in reward.get_lines()}
    assert colors["run: rollout/reward_mean"] != colors["other: rollout/reward_mean"]
    out = tmp_path / "cmp.png"
    assert main(["report", str(dumped_run), str(other), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert main(["report", str(dumped_run), str(tmp_path / "missing")]) == 2
    assert "missing/metrics.jsonl: not found" in capsys.readouterr().err
