"""A calculator tool rollout: a multi-turn, token-in/token-out :class:`~rl_core.interfaces.GenerateFn`.

The model writes a tool call on its own line, the rollout appends the tool's answer as
observation tokens (loss mask 0), and the model continues::

    <prompt>What is 12+7? ...<|im_start|>assistant\\n
    CALC: 12+7\\n                 model tokens      (mask 1)
    = 19\\n                       observation tokens (mask 0)
    ANSWER: 19<|im_end|>          model tokens      (mask 1)

Pair it with a reward that reads the final answer, e.g.
``ExactMatch(ExactMatch.Config(answer_pattern=r"ANSWER:\\s*(\\S+)"))``. In a recipe::

    generate_fn: {type: "rl_agents.examples.calculator:CalculatorRollout", max_turns: 4}
    reward: {type: exact_match, answer_pattern: "ANSWER:\\\\s*(\\\\S+)"}

Set the sampling ``stop_token_ids`` to the newline token(s) of your tokenizer so that a model
turn ends right after the call; the rollout calls the tool for the *last* ``CALC:`` of a turn
and ends the trajectory when a turn holds no call, the engine stops for another reason than a
stop token, the turn budget is spent, or the length budget is full.

:func:`evaluate` is the tool: integer arithmetic with ``+ - * /`` and parentheses, parsed with
:mod:`ast` (no ``eval``), bounded in length and magnitude; a bad expression gives an
``error: ...`` observation rather than an exception, so the model can learn from it.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated

from rl_agents.trajectory import TrajectoryBuilder
from rl_core.config import PositiveInt, Range
from rl_core.errors import ConfigError
from rl_core.interfaces import RolloutContext
from rl_core.types import FinishReason, Prompt, Rollout

__all__ = ["CALL_PATTERN", "CalculatorRollout", "evaluate"]

CALL_PATTERN = re.compile(r"CALC:\s*([^\n]+)")
"""A tool call: ``CALC:`` followed by an expression up to the end of the line."""

_MAX_EXPR_CHARS = 64
_MAX_ABS = 10**18


def evaluate(expression: str) -> str:
    """Evaluate integer arithmetic (``+ - * /``, unary minus, parentheses) safely.

    Returns the result as text (``"19"``; exact fractions as decimals rounded to 6 places, e.g.
    ``"0.333333"``) or ``"error: <reason>"``: never raises, never runs code.
    """
    expr = expression.strip()
    if len(expr) > _MAX_EXPR_CHARS:
        return f"error: expression longer than {_MAX_EXPR_CHARS} characters"
    try:
        tree = ast.parse(expr, mode="eval")
        value = _eval(tree.body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, OverflowError) as e:
        return f"error: {e}" if str(e) else "error: invalid expression"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        out = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        out = -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, ast.BinOp) and isinstance(
        node.op, ast.Add | ast.Sub | ast.Mult | ast.Div
    ):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Add):
            out = a + b
        elif isinstance(node.op, ast.Sub):
            out = a - b
        elif isinstance(node.op, ast.Mult):
            out = a * b
        else:
            out = a / b
    else:
        raise ValueError("only integers, + - * / and parentheses are allowed")
    if abs(out) > _MAX_ABS:
        raise OverflowError("result too large")
    return out


class CalculatorRollout:
    """GenerateFn: ``ctx.n_samples`` calculator-tool trajectories per prompt (see the module
    docstring). Each rollout's metadata has ``turns``, ``model_turns`` and ``tool_calls``."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`CalculatorRollout`."""

        max_turns: PositiveInt = 4
        """Model turns per trajectory at most (tool calls at most ``max_turns - 1``)."""
        max_length: Annotated[int, Range(ge=2)] = 1024
        """Token budget of a trajectory (prompt included)."""
        observation_template: str = "= {result}\n"
        """Text appended after a call; ``{result}`` is the tool's answer."""

        def __post_init__(self) -> None:
            if self.max_turns < 1:
                raise ConfigError(f"generate_fn.max_turns: must be >= 1, got {self.max_turns}.")
            if self.max_length < 2:
                raise ConfigError(f"generate_fn.max_length: must be >= 2, got {self.max_length}.")
            if "{result}" not in self.observation_template:
                raise ConfigError(
                    "generate_fn.observation_template: must contain '{result}', got "
                    f"{self.observation_template!r}."
                )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or CalculatorRollout.Config()

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """Sample ``ctx.n_samples`` trajectories concurrently."""
        return list(
            await asyncio.gather(*(self._one(prompt, ctx, k) for k in range(ctx.n_samples)))
        )

    async def _one(self, prompt: Prompt, ctx: RolloutContext, k: int) -> Rollout:
        c = self.config
        traj = TrajectoryBuilder(
            prompt.token_ids,
            TrajectoryBuilder.Config(max_length=c.max_length),
            version=ctx.policy_version,
        )
        calls = 0
        for turn in range(c.max_turns):
            sampling = traj.clamp(ctx.sampling)
            if sampling.seed is not None:  # distinct, reproducible seeds per sample and turn
                seed = (sampling.seed * 1_000_003 + k * 1_009 + turn) & 0x7FFFFFFF
                sampling = dataclasses.replace(sampling, seed=seed)
            result = await ctx.generate(
                traj.input_ids, sampling, request_id=f"{prompt.uid}/{k}/{turn}"
            )
            traj.append_model(result)
            # Read the model's text; its ids stay exactly as sampled.
            calls_in_turn = CALL_PATTERN.findall(ctx.tokenizer.decode(list(result.output_ids)))
            last_turn = turn == c.max_turns - 1
            if (
                not calls_in_turn
                or result.finish_reason != FinishReason.STOP
                or last_turn
                or traj.is_full
            ):
                break
            calls += 1
            observation = c.observation_template.format(result=evaluate(calls_in_turn[-1]))
            traj.append_text(observation, ctx.tokenizer)
            if traj.is_full:
                break
        return traj.to_rollout(prompt.uid, f"{prompt.uid}/{k}", metadata={"tool_calls": calls})
