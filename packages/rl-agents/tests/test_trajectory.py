"""Multi-turn token-in/token-out trajectories: alignment, no re-encoding, packing, fan-out."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch

from rl_agents.trajectory import TrajectoryBuilder, TurnKind, siblings
from rl_core.algorithms import compute_loss_weights
from rl_core.batching import pack_rollouts
from rl_core.errors import ConfigError, DataError, RLError
from rl_core.interfaces import Generator, RolloutContext
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutStatus,
    SamplingParams,
)


def _result(ids, *, version=3, reason=FinishReason.STOP, rid="r") -> GenerationResult:
    ids = tuple(ids)
    return GenerationResult(
        request_id=rid,
        output_ids=ids,
        output_logprobs=tuple(-0.125 * (i + 1) for i in range(len(ids))),
        finish_reason=reason,
        weight_version=version,
    )


class ScriptedGenerator(Generator):
    """Returns scripted token ids turn after turn and records every request's input ids."""

    def __init__(self, script: Sequence[Sequence[int]], version: int = 5) -> None:
        self.script = [tuple(s) for s in script]
        self.seen: list[tuple[int, ...]] = []
        self.max_new: list[int] = []
        self._version = version

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for req in requests:
            self.seen.append(req.input_ids)
            self.max_new.append(req.sampling.max_new_tokens)
            ids = self.script[len(self.seen) - 1][: req.sampling.max_new_tokens]
            out.append(_result(ids, version=self._version, rid=req.request_id))
        return out

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


class MergingTokenizer:
    """Characters are ids ``ord(c)``, but ``encode`` merges "ab" into the single id 1000, so
    ``encode(decode([97, 98])) == [1000] != [97, 98]``: the round trip is not the identity."""

    eos_token_id = 3
    pad_token_id = 0
    AB = 1000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(self.AB)
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [t for t in ids if t != self.eos_token_id]
        return "".join("ab" if t == self.AB else chr(t) for t in ids)


async def _tool_loop(prompt_ids, ctx: RolloutContext, observations: Sequence[str]):
    """A 3-model-turn tool loop: model turn, observation text, model turn, ... (what a
    GenerateFn does)."""
    traj = TrajectoryBuilder(prompt_ids, version=ctx.policy_version)
    for turn in range(len(observations) + 1):
        # The engine is always sent exactly the trajectory so far.
        result = await ctx.generate(traj.input_ids, request_id=f"t{turn}")
        traj.append_model(result)
        if turn < len(observations):
            traj.append_text(observations[turn], ctx.tokenizer)
    return traj


def _ctx(gen: Generator, tok) -> RolloutContext:
    return RolloutContext(
        generator=gen,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=32),
        n_samples=1,
        policy_version=5,
    )


def test_three_turns_aligned_with_reference_tokenizer():
    from rl_hf.tokenizer import build_tokenizer

    tok = build_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "12+7?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = list(tok.encode(text, add_special_tokens=False))
    assert prompt_ids[0] == 257  # <|im_start|>
    # Turn 1 samples a lone UTF-8 lead byte (0xC3) then "CALC"; decoding that and re-encoding
    # would turn 0xC3 into the 3 bytes of U+FFFD. Turn 3 ends with the eos id 258.
    m1 = [0xC3, *b"CALC: 12+7"]
    m2 = list(b"so 19")
    m3 = [*b"19", 258]
    assert tok.encode(tok.decode(m1), add_special_tokens=False) != m1  # the trap is real
    gen = ScriptedGenerator([m1, m2, m3])
    obs = ["\n= 19\n", "\nok\n"]
    traj = asyncio.run(_tool_loop(prompt_ids, _ctx(gen, tok), obs))

    o1 = list(tok.encode(obs[0], add_special_tokens=False))
    o2 = list(tok.encode(obs[1], add_special_tokens=False))
    response = m1 + o1 + m2 + o2 + m3
    r = traj.to_rollout("p0", "p0/0")
    assert r.tokens == tuple(prompt_ids) + tuple(response)
    assert r.response_start == len(prompt_ids)
    assert r.loss_mask == (1,) * len(m1) + (0,) * len(o1) + (1,) * len(m2) + (0,) * len(o2) + (
        1,
    ) * len(m3)
    lp = lambda n: tuple(-0.125 * (i + 1) for i in range(n))  # noqa: E731
    assert r.rollout_logprobs == lp(len(m1)) + (0.0,) * len(o1) + lp(len(m2)) + (0.0,) * len(
        o2
    ) + lp(len(m3))
    assert r.versions == (5,) * len(response)
    assert r.status == RolloutStatus.COMPLETED
    assert r.metadata == {"turns": 5, "model_turns": 3}
    # Each request carried exactly the trajectory so far.
    assert gen.seen == [
        tuple(prompt_ids),
        tuple(prompt_ids + m1 + o1),
        tuple(prompt_ids + m1 + o1 + m2 + o2),
    ]
    assert [t.kind for t in traj.turns] == [TurnKind.MODEL, TurnKind.TOOL] * 2 + [TurnKind.MODEL]


def test_merging_tokenizer_keeps_engine_ids_exactly():
    tok = MergingTokenizer()
    prompt_ids = tok.encode("Q: ab?")  # [81, 58, 32, 1000, 63]
    assert prompt_ids == [81, 58, 32, 1000, 63]
    m1, m2, m3 = [97, 98, 120], [120, 97, 98], [97, 98, 3]  # "abx", "xab", "ab<eos>"
    # Decode + re-encode would merge every "ab" pair into 1000.
    for m in (m1, m2, m3):
        assert tok.encode(tok.decode(m)) != m
    gen = ScriptedGenerator([m1, m2, m3])
    traj = asyncio.run(_tool_loop(prompt_ids, _ctx(gen, tok), ["=ab", "c"]))
    r = traj.to_rollout("q", "q/0")
    # Observation text is encoded once (the "ab" in it merges: it is the tool's own text).
    assert r.response_ids == (*m1, 61, 1000, *m2, 99, *m3)
    assert r.loss_mask == (1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1)
    assert sum(r.loss_mask) == 9
    assert gen.seen[2] == tuple(prompt_ids + m1 + [61, 1000] + m2 + [99])
    # What a re-tokenizing implementation would have produced differs from what we keep.
    retokenized = tok.encode(tok.decode(list(r.tokens)))
    assert tuple(retokenized) != r.tokens
    assert len(retokenized) == len(r.tokens) - 3


def test_pack_multi_turn_rollout_masks_tool_tokens():
    traj = TrajectoryBuilder([7, 8, 9])
    traj.append_model(_result([10, 11], version=1))
    traj.append_tokens([20, 21, 22])  # version defaults to the last model turn's
    traj.append_model(_result([12], version=2))
    r = traj.to_rollout("p", "p/0")
    assert r.versions == (1, 1, 1, 1, 1, 2)
    batch = pack_rollouts([r], advantages=[[1.0] * 6])
    assert batch.tokens.tolist() == [7, 8, 9, 10, 11, 20, 21, 22, 12]
    assert batch.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert batch.advantages.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert batch.rollout_logprobs.tolist() == [0, 0, 0, -0.125, -0.25, 0, 0, 0, -0.125]
    assert batch.versions.tolist() == [-1, -1, -1, 1, 1, 1, 1, 1, 2]
    # Token-mean weights: 3 trained tokens, 1/3 each, none on tool tokens.
    assert batch.loss_weights.tolist() == pytest.approx([0, 0, 0, 1 / 3, 1 / 3, 0, 0, 0, 1 / 3])


def test_fan_out_siblings_count_once():
    parent = TrajectoryBuilder([1, 2])
    parent.append_model(_result([3, 4]))
    branch = parent.fork()
    parent.append_tokens([5])
    parent.append_model(_result([6, 7]))  # parent: 4 trained tokens
    branch.append_model(_result([8, 9, 10, 11]))  # branch: 6 trained tokens (fork is independent)
    assert parent.input_ids == (1, 2, 3, 4, 5, 6, 7)
    assert branch.input_ids == (1, 2, 3, 4, 8, 9, 10, 11)
    fan = siblings([parent, branch], prompt_uid="p", rollout_id="p/0")
    assert [r.sample_id for r in fan] == ["p/0/0", "p/0/1"]
    assert {r.rollout_id for r in fan} == {"p/0"}
    assert [r.metadata["sibling"] for r in fan] == [0, 1]
    single = TrajectoryBuilder([1])
    single.append_model(_result([2, 3]))
    rollouts = [*fan, single.to_rollout("q", "q/0")]
    batch = pack_rollouts(rollouts)
    w_T = compute_loss_weights(
        batch.loss_mask,
        batch.cu_seqlens,
        mode="rollout",
        rollout_ids=[r.rollout_id for r in rollouts],
    )
    # 2 rollouts (the siblings count once): sibling tokens 1/(10*2) each, the single's 1/(2*2).
    m = batch.loss_mask
    assert float(w_T[m > 0][:10].sum()) == pytest.approx(0.5)
    assert w_T[m > 0][:10].tolist() == pytest.approx([1 / 20] * 10)
    assert w_T[m > 0][10:].tolist() == pytest.approx([1 / 4, 1 / 4])
    assert float(w_T.sum()) == pytest.approx(1.0)
    # Versus "sequence", which would count three sequences.
    w_seq = compute_loss_weights(batch.loss_mask, batch.cu_seqlens, mode="sequence")
    assert w_seq[m > 0][10:].tolist() == pytest.approx([1 / 6, 1 / 6])
    assert torch.equal(w_T[m == 0], torch.zeros(int((m == 0).sum())))


def test_logprob_count_mismatch_names_turn():
    traj = TrajectoryBuilder([1, 2])
    traj.append_model(_result([3]))
    bad = SimpleNamespace(
        request_id="x",
        output_ids=(4, 5),
        output_logprobs=(-0.1,),
        finish_reason=FinishReason.STOP,
        weight_version=1,
    )
    with pytest.raises(DataError, match=r"turn 1 .*2 token ids but 1 log-probs"):
        traj.append_model(bad)
    assert traj.input_ids == (1, 2, 3)  # nothing appended
    traj.validate()


@pytest.mark.parametrize(
    ("logprobs", "match"),
    [((float("nan"),), "finite"), ((0.5,), "<= 0")],
)
def test_invalid_logprobs_rejected(logprobs, match):
    traj = TrajectoryBuilder([1])
    bad = SimpleNamespace(
        request_id="x",
        output_ids=(4,),
        output_logprobs=logprobs,
        finish_reason=FinishReason.STOP,
        weight_version=1,
    )
    with pytest.raises(DataError, match=match):
        traj.append_model(bad)


def test_empty_model_turn():
    traj = TrajectoryBuilder([1])
    with pytest.raises(DataError, match="allow_empty_model_turn"):
        traj.append_model(_result([], reason=FinishReason.ABORT))
    ok = TrajectoryBuilder([1], TrajectoryBuilder.Config(allow_empty_model_turn=True))
    ok.append_model(_result([], reason=FinishReason.ABORT))
    assert ok.to_rollout("p", "s").status == RolloutStatus.ABORTED


def test_max_length_budget():
    traj = TrajectoryBuilder([1, 2], TrajectoryBuilder.Config(max_length=6))
    assert traj.clamp(SamplingParams(max_new_tokens=10)).max_new_tokens == 4
    traj.append_model(_result([3, 4]))
    assert traj.remaining == 2 and not traj.is_full
    traj.append_tokens([5, 6, 7])  # tool output goes over the budget
    assert traj.is_full and traj.remaining == -1
    with pytest.raises(DataError, match=r"turn 2 .*max_length=6.*is_full"):
        traj.append_model(_result([8]))
    r = traj.to_rollout("p", "s")
    assert r.tokens == (1, 2, 3, 4, 5, 6)  # cut to the budget
    assert r.loss_mask == (1, 1, 0, 0)
    assert r.status == RolloutStatus.TRUNCATED
    with pytest.raises(ConfigError, match="max_length"):
        TrajectoryBuilder.Config(max_length=0)


def test_clamp_is_sent_to_engine():
    tok = MergingTokenizer()
    gen = ScriptedGenerator([[97] * 10])
    ctx = _ctx(gen, tok)
    traj = TrajectoryBuilder([1, 2, 3], TrajectoryBuilder.Config(max_length=7))
    result = asyncio.run(ctx.generate(traj.input_ids, traj.clamp(ctx.sampling), request_id="a"))
    traj.append_model(result)
    assert gen.max_new == [4]
    assert len(traj.input_ids) == 7 and traj.is_full


def test_bad_inputs_are_data_errors():
    with pytest.raises(DataError, match="no token ids"):
        TrajectoryBuilder([])
    traj = TrajectoryBuilder([1])
    with pytest.raises(DataError, match="non-negative ints"):
        traj.append_tokens(["a"])  # type: ignore[list-item]
    with pytest.raises(DataError, match="no model turn"):
        traj.to_rollout("p", "s")
    assert traj.to_rollout("p", "s", status=RolloutStatus.FAILED).response_length == 0
    # Tampering with internals is caught at the end.
    traj.append_model(_result([2, 3]))
    traj._mask.append(1)
    with pytest.raises(DataError, match="aligned"):
        traj.to_rollout("p", "s")
    assert issubclass(DataError, RLError)


def test_explicit_version_and_status_and_metadata():
    traj = TrajectoryBuilder([1], version=4)
    traj.append_tokens([9], version=None)  # before any model turn: the builder's version
    traj.append_model(_result([2], version=6, reason=FinishReason.LENGTH))
    traj.append_tokens([9], version=7)
    r = traj.to_rollout("p", "s", "root", metadata={"tool_calls": 1})
    assert r.versions == (4, 6, 7)
    assert r.status == RolloutStatus.TRUNCATED
    assert r.rollout_id == "root" and r.sample_id == "s"
    assert r.metadata == {"turns": 3, "model_turns": 1, "tool_calls": 1}
    r2 = traj.to_rollout("p", "s", status=RolloutStatus.FAILED)
    assert r2.status == RolloutStatus.FAILED
    assert dataclasses.replace(r2, reward=1.0).reward == 1.0


def test_docstring_example_runs_as_a_generate_fn():
    """The calculator GenerateFn in the module docstring is executable and correct."""
    import re

    import rl_agents.trajectory as mod

    src = mod.__doc__.split("Worked example", 1)[1].split("::", 1)[1]
    code = "\n".join(line[4:] for line in src.splitlines())
    ns: dict = {}
    exec(compile(code, "<docstring>", "exec"), ns)
    tok = MergingTokenizer()
    prompt = Prompt(uid="u", input="12+7", token_ids=tuple(tok.encode("12+7?")))
    gen = ScriptedGenerator([list(b"CALC: 12+7"), [*b"19", 3]])
    ctx = dataclasses.replace(_ctx(gen, tok), n_samples=1)
    (r,) = asyncio.run(ns["calculator_rollouts"](prompt, ctx))
    obs = tok.encode("\n= 19\n")
    assert r.response_ids == tuple(list(b"CALC: 12+7") + obs + [*b"19", 3])
    assert r.loss_mask == (1,) * 10 + (0,) * len(obs) + (1,) * 3
    assert re.search(r"= 19", tok.decode(list(r.response_ids)))


# ------------------------------------------------------------------------------------------
# The calculator example (rl_agents.examples.calculator)
# ------------------------------------------------------------------------------------------


class RuleGenerator(Generator):
    """A fake "model" that reads its input: no tool answer yet -> emits ``first``; after a
    tool answer -> emits ``then`` + EOS. Every reply is ``STOP``."""

    def __init__(self, tok: MergingTokenizer, first: str, then: str) -> None:
        self.tok, self.first, self.then = tok, first, then
        self.requests: list[GenerationRequest] = []

    @property
    def weight_version(self) -> int:
        return 9

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for req in requests:
            self.requests.append(req)
            seen = self.tok.decode(list(req.input_ids))
            text = self.first if "= " not in seen else self.then
            # Sampled char by char: "ab" would be two ids, never the merged 1000.
            ids = [ord(ch) for ch in text] + ([3] if "= " in seen else [])
            out.append(_result(ids, version=9, rid=req.request_id))
        return out

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


def test_calculator_example_end_to_end():
    from rl_agents.examples.calculator import CalculatorRollout
    from rl_core import registry
    from rl_core.config import ComponentSpec
    from rl_core.interfaces import GenerateFn
    from rl_core.rewards import ExactMatch

    tok = MergingTokenizer()
    gen = RuleGenerator(tok, "CALC: 12+7\n", "ab ANSWER: 19")
    fn = registry.build(
        "generate_fn",
        ComponentSpec(
            type="rl_agents.examples.calculator:CalculatorRollout", options={"max_turns": 3}
        ),
    )
    assert isinstance(fn, CalculatorRollout) and isinstance(fn, GenerateFn)
    registry.check_callable(fn, GenerateFn, field="generate_fn", n_args=2)
    prompt = Prompt(uid="u", input="12+7?", token_ids=tuple(tok.encode("12+7?\n")), label="19")
    ctx = dataclasses.replace(_ctx(gen, tok), n_samples=2, sampling=SamplingParams(seed=11))
    rollouts = asyncio.run(fn(prompt, ctx))
    assert [r.sample_id for r in rollouts] == ["u/0", "u/1"]
    m1 = [ord(c) for c in "CALC: 12+7\n"]
    obs = tok.encode("= 19\n")
    m2 = [97, 98, *(ord(c) for c in " ANSWER: 19"), 3]
    for r in rollouts:
        assert r.response_ids == (*m1, *obs, *m2)  # "ab" kept as 97, 98
        assert r.loss_mask == (1,) * len(m1) + (0,) * len(obs) + (1,) * len(m2)
        assert r.versions == (9,) * len(r.response_ids)
        assert r.metadata == {"turns": 3, "model_turns": 2, "tool_calls": 1}
        assert r.status == RolloutStatus.COMPLETED
        text = tok.decode(list(r.response_ids), skip_special_tokens=True)  # as the trainer does
        assert text == "CALC: 12+7\n= 19\nab ANSWER: 19"
        assert (
            ExactMatch(ExactMatch.Config(answer_pattern=r"ANSWER:\s*(\S+)"))(prompt, text, r) == 1.0
        )
    # Distinct, reproducible seeds per sample and turn.
    seeds = [q.sampling.seed for q in gen.requests]
    assert len(set(seeds)) == 4 and None not in seeds


def test_calculator_example_turn_cap_and_tool_errors():
    from rl_agents.examples.calculator import CalculatorRollout, evaluate

    assert evaluate("12+7") == "19"
    assert evaluate("(2+3)*4") == "20"
    assert evaluate("1/3") == "0.333333"
    assert evaluate("7/0") == "error: division by zero"
    assert evaluate("2**100").startswith("error: only integers")
    assert evaluate('__import__("os")').startswith("error: only integers")
    assert evaluate("1+").startswith("error")
    tok = MergingTokenizer()
    # A model that keeps calling the tool is cut at max_turns model turns.
    gen = RuleGenerator(tok, "CALC: 1/0\n", "CALC: 2*3\n")
    fn = CalculatorRollout(CalculatorRollout.Config(max_turns=3))
    prompt = Prompt(uid="v", input="?", token_ids=(63,))
    (r,) = asyncio.run(fn(prompt, _ctx(gen, tok)))
    text = tok.decode(list(r.response_ids))
    assert text == "CALC: 1/0\n= error: division by zero\nCALC: 2*3\n\x03= 6\nCALC: 2*3\n\x03"
    assert r.metadata["model_turns"] == 3 and r.metadata["tool_calls"] == 2
    with pytest.raises(ConfigError, match="observation_template"):
        CalculatorRollout.Config(observation_template="no slot")
