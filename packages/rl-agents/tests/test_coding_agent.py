"""The black-box coding agent: the bundled openai-client agent program, run as a subprocess
against the agent server, writes a file and runs it through the sandboxed shell tool; hidden
tests in a fresh sandbox give the reward; the episode is written to disk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from rl_agents.examples.coding_agent import CodingAgentRollout, CodingTasks
from rl_core.interfaces import Generator, RolloutContext
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutStatus,
    SamplingParams,
)
from rl_hf import build_tokenizer


def _call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


class Scripted(Generator):
    """Answers each session with the next scripted text (encoded + EOS), fixed log-probs."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.results: list[GenerationResult] = []

    @property
    def weight_version(self) -> int:
        return 5

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in requests:
            ids = tuple(self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False))
            ids += (self.tokenizer.eos_token_id,)
            out.append(
                GenerationResult(
                    request_id=r.request_id,
                    output_ids=ids,
                    output_logprobs=tuple(-0.5 for _ in ids),
                    finish_reason=FinishReason.STOP,
                    weight_version=5,
                )
            )
        self.results.extend(out)
        return out

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


def _run(gen, tok, prompt, tmp_path, **opts):
    fn = CodingAgentRollout(
        CodingAgentRollout.Config(episodes_dir=str(tmp_path / "episodes"), timeout_s=120, **opts)
    )
    ctx = RolloutContext(
        generator=gen,
        tokenizer=tok,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=200),
        n_samples=1,
        policy_version=5,
    )

    async def main():
        try:
            return await fn(prompt, ctx)
        finally:
            await fn.aclose()

    return fn, asyncio.run(main())


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _prompt(tok) -> Prompt:
    ex = next(e for e in CodingTasks().examples("train") if "add(2, 3) == 5" in e["label"]["tests"])
    return Prompt(
        uid="p0",
        input=ex["prompt"],
        token_ids=tuple(tok.encode(ex["prompt"], add_special_tokens=False)),
        label=ex["label"],
    )


def test_agent_writes_runs_and_passes_hidden_tests(tok, tmp_path):
    code = "def add(a, b):\n    return a + b\n"
    gen = Scripted(
        tok,
        [
            _call("write_file", path="solution.py", content=code),
            _call("run_shell", command="python3 -c 'import solution; print(solution.add(2, 3))'"),
            "Done: add works.",
        ],
    )
    fn, rollouts = _run(gen, tok, _prompt(tok), tmp_path)
    (r,) = rollouts  # three turns, merged: each prompt extends the held tokens
    assert r.status == RolloutStatus.COMPLETED
    assert r.metadata["session_reward"] == 1.0 and r.metadata["tests_passed"] == 3
    assert r.metadata["tool_calls"] == 2 and r.metadata["session_turns"] == 3
    assert r.metadata["sandbox"] == fn.sandbox.isolation
    text = tok.decode(list(r.response_ids))
    # The shell tool's answer came from the sandboxed run of the agent's file.
    assert "exit code 0\n5\n" in text
    n_model = sum(len(x.output_ids) for x in gen.results)
    assert sum(r.loss_mask) == n_model and set(r.versions) == {5}
    (episode,) = (tmp_path / "episodes").iterdir()
    data = json.loads(episode.read_text())
    assert [len(t["tool_calls"]) for t in data["turns"]] == [1, 1, 0]
    assert [t["output_tokens"] for t in data["turns"]] == [len(x.output_ids) for x in gen.results]
    assert data["reward"] == 1.0 and data["tests_total"] == 3
    assert data["files"]["solution.py"] == code
    assert json.loads(data["agent"]["stdout"].splitlines()[-1])["tool_calls"] == 2


def test_wrong_code_and_tampering_do_not_pass(tok, tmp_path):
    """The agent's own 'tests' file and a wrong solution: the hidden tests run in a fresh root
    with only solution.py, so only the real pass rate counts."""
    gen = Scripted(
        tok,
        [
            _call("write_file", path="solution.py", content="def add(a, b):\n    return 5\n"),
            _call("write_file", path="run_tests.py", content="print('{\"passed\": 3}')"),
            "Done.",
        ],
    )
    _, (r,) = _run(gen, tok, _prompt(tok), tmp_path)
    assert r.metadata["tests_passed"] == 1  # add(2, 3) == 5 only
    assert r.metadata["session_reward"] == pytest.approx(1 / 3)


def test_agent_that_crashes_gives_failed_rollouts(tok, tmp_path):
    gen = Scripted(tok, ["unused"])
    _, (r,) = _run(
        gen, tok, _prompt(tok), tmp_path, command=["python3", "-c", "raise SystemExit(3)"]
    )
    assert r.status == RolloutStatus.FAILED and "exited with 3" in r.metadata["failure"]
