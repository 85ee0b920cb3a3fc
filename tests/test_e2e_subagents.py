"""One prompt, many samples through the trainer: a rollout function whose episodes are a main
agent plus a varying number of sub-agent trajectories (siblings sharing a ``rollout_id``).
The global batch varies with them, and every step trains exactly the siblings of its
episodes, all of them (a logging wrapper records what the rollout function returned)."""

from __future__ import annotations

import json
import textwrap

WRAPPER = '''
import json, os
from rl_agents.examples.subagents import SubAgentRollout


class Logged(SubAgentRollout):
    """SubAgentRollout that appends (policy version, rollout id, sample id) per sample."""

    async def __call__(self, prompt, ctx):
        out = await super().__call__(prompt, ctx)
        with open(os.environ["FANOUT_LOG"], "a") as f:
            for r in out:
                f.write(json.dumps([ctx.policy_version, r.rollout_id, r.sample_id,
                                    r.metadata["num_siblings"]]) + "\\n")
        return out
'''


def test_subagent_siblings_vary_the_batch_and_train_together(tmp_path, cli, monkeypatch):
    extra = __import__("os").environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{extra}" if extra else str(tmp_path))
    log = tmp_path / "fanout.jsonl"
    monkeypatch.setenv("FANOUT_LOG", str(log))
    (tmp_path / "fanout_fn.py").write_text(textwrap.dedent(WRAPPER))
    run_dir = tmp_path / "run"
    recipe = tmp_path / "fanout.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""
            run_dir: {run_dir}
            seed: 4
            model:
              init: {{arch: qwen2, hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1,
                      intermediate_size: 64}}
            task: {{type: reverse, n_train: 64, n_eval: 4, min_len: 2, max_len: 4}}
            reward: {{type: session_reward}}
            rollout:
              prompts_per_step: 3
              n_samples: 2
              sampling: {{temperature: 1.0, max_new_tokens: 5}}
              generate_fn: {{type: "fanout_fn:Logged", max_subagents: 2}}
            algorithm: {{advantage: grpo, aggregation: rollout}}
            rl: {{steps: 3}}
            eval: {{every: 0}}
            logging: {{tensorboard: false, progress: false}}
            """
        )
    )
    proc = cli("run", str(recipe), cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl" and r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2, 3]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    for r in rl:
        # Step s trains the train episodes version s-1 generated (eval ones are not trained).
        made = [x for x in logged if x[0] == r["step"] - 1 and x[1].startswith("train")]
        episodes = {x[1] for x in made}
        assert r["train/episodes"] == len(episodes) == 3 * 2
        assert r["train/samples"] == len(made)  # every sibling of every episode, no other
        for rid in episodes:  # each episode's siblings all came in that step
            sibs = [x for x in made if x[1] == rid]
            assert len(sibs) == sibs[0][3]
        assert not any(k.startswith("rollout/failed/") for k in r), r
    samples = [r["train/samples"] for r in rl]
    assert len(set(samples)) > 1 and max(samples) > 6, samples  # the global batch varies
