"""``mode: sft``: supervised fine-tuning on chat conversations, loss on assistant turns only.

The training records are conversations (``data.train``: a prompt source whose ``input_key``
holds a list of ``{"role", "content"}`` messages, e.g. ``{type: jsonl, path: chat.jsonl,
input_key: messages, label_key: null, apply_chat_template: true}``). Each one is rendered with
the tokenizer's chat template **incrementally**: message ``i`` contributes the text the template
adds when the conversation grows from ``messages[:i]`` to ``messages[:i+1]``, and before an
assistant message the generation prompt (``add_generation_prompt=True``, e.g.
``<|im_start|>assistant\\n``) is split off, so the conversation's tokens are::

    [system/user turn][gen. prompt][assistant content + end-of-turn][\\n][user turn]...
      loss 0            loss 0      loss 1                          0    loss 0

The trained span of an assistant turn is its content and the template's end-of-turn token (the
model learns to stop); trailing whitespace after it is not trained. A template whose rendering
of a prefix is not a prefix of the longer conversation's (one that rewrites earlier turns, e.g.
drops past reasoning) cannot be split this way and is refused with a ``DataError``. Each segment
is encoded separately, so the mask is exact by construction.

The step loop, checkpoints and resume are the warm-up's (:mod:`rl_trainer.phases.sft`): ``sft.steps``
steps of ``sft.batch_size`` conversations, packed into micro-batches of at most
``rl.max_tokens_per_micro_batch`` tokens (:func:`rl_trainer.step.packing.plan_and_pack`), with the
policy's learning rate (or ``sft.lr``). ``eval/loss`` (mean assistant-token NLL of
``data.eval``, at most ``eval.max_prompts`` conversations) is logged at step 0, every
``eval.every`` steps and at the last step; the final weights go to ``final_model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rl_core import registry
from rl_core.errors import DataError
from rl_core.types import Prompt, Rollout
from rl_trainer.step.packing import plan_and_pack

if TYPE_CHECKING:
    from rl_trainer.config import TrainerConfig

__all__ = [
    "assistant_tokens",
    "chat_rollouts",
    "eval_due",
    "eval_loss",
    "eval_rollouts",
]


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], gen: bool, where: str) -> str:
    if not messages and not gen:
        return ""
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=gen
        )
    except Exception as e:  # the template is user code (Jinja); name the record
        if not messages:  # a template that cannot render an empty conversation
            return ""
        raise DataError(f"{where}: the chat template failed on this conversation: {e}") from e
    if not isinstance(text, str):
        raise DataError(f"{where}: the chat template returned {type(text).__name__}, not text.")
    return text


def assistant_tokens(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, where: str = "conversation"
) -> tuple[list[int], list[int]]:
    """``(token ids, loss mask)`` of a conversation rendered by ``tokenizer``'s chat template,
    the mask 1 exactly on assistant content and end-of-turn tokens (module docstring).

    Raises:
        DataError: no assistant message, a template that is not prefix-consistent, or a
            template that fails.
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message; mode: sft trains on assistant turns.")
    segments: list[tuple[str, int]] = []  # (text, trained)
    done = ""
    for i, m in enumerate(messages):
        full = _render(tokenizer, messages[: i + 1], False, where)
        parts = [(full, 0)]
        if m.get("role") == "assistant":
            prompt = _render(tokenizer, messages[:i], True, where)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise _not_prefix(where, i)
            body = full[len(prompt) :]
            kept = body.rstrip()
            parts = [(prompt, 0), (prompt + kept, 1), (full, 0)]
        for text, trained in parts:
            if not text.startswith(done):
                raise _not_prefix(where, i)
            if len(text) > len(done):
                segments.append((text[len(done) :], trained))
                done = text
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in segments:
        seg = list(tokenizer.encode(text, add_special_tokens=False))
        ids += seg
        mask += [trained] * len(seg)
    if not any(mask):
        raise DataError(f"{where}: the assistant turns render to no tokens.")
    return ids, mask


def _not_prefix(where: str, i: int) -> DataError:
    return DataError(
        f"{where}: the chat template renders messages[:{i}] as text that is not a prefix of "
        f"messages[:{i + 1}] (it rewrites earlier turns), so assistant tokens cannot be "
        "located; use a template that renders each turn independently (e.g. ChatML)."
    )


def chat_rollouts(prompts: Sequence[Prompt], tokenizer: Any, version: int) -> list[Rollout]:
    """Each conversation as a rollout: ``response_start`` at its first trained token, the loss
    mask 1 on assistant tokens only (:func:`assistant_tokens`)."""
    out = []
    for p in prompts:
        where = f"data: conversation {p.uid}"
        if isinstance(p.input, str):
            raise DataError(
                f"{where}: is plain text; mode: sft needs chat records (a list of "
                "{'role', 'content'} messages under data.train's input_key, with "
                "apply_chat_template: true)."
            )
        ids, mask = assistant_tokens(p.input, tokenizer, where=where)
        start = max(mask.index(1), 1)
        n = len(ids) - start
        out.append(
            Rollout(
                prompt_uid=p.uid,
                rollout_id=p.uid,
                sample_id=p.uid,
                tokens=tuple(ids),
                response_start=start,
                loss_mask=tuple(mask[start:]),
                rollout_logprobs=(0.0,) * n,
                versions=(version,) * n,
            )
        )
    return out


def eval_due(cfg: TrainerConfig, sft_step: int) -> bool:
    """Whether ``eval/loss`` is due after SFT step ``sft_step`` (``data.eval`` set; step 0,
    every ``eval.every`` steps, and the last)."""
    if cfg.data.eval is None:
        return False
    s, every = sft_step, cfg.eval.every
    return s == 0 or s == cfg.sft.steps or (every > 0 and s % every == 0)


def eval_rollouts(cfg: TrainerConfig, tokenizer: Any) -> list[Rollout]:
    """The held-out conversations (``data.eval``, the first ``eval.max_prompts``) as rollouts;
    empty without ``data.eval``."""
    if cfg.data.eval is None:
        return []
    src = registry.build("data_source", cfg.data.eval, field="data.eval", tokenizer=tokenizer)
    n = len(src) if cfg.eval.max_prompts is None else min(len(src), cfg.eval.max_prompts)
    return chat_rollouts(src.next_prompts(n), tokenizer, 0)


def eval_loss(policy: Any, rollouts: Sequence[Rollout], cap: int) -> dict[str, float]:
    """``eval/loss``: mean negative log-likelihood per assistant token of the held-out
    conversations ``rollouts`` under ``policy`` (no gradients, micro-batched like training,
    ``cap``: ``rl.max_tokens_per_micro_batch``)."""
    if not rollouts:
        return {}
    nll, count = 0.0, 0.0
    for i in range(0, len(rollouts), 64):
        batch, _ = plan_and_pack(list(rollouts[i : i + 64]), policy, cap)
        logp_T = policy.compute_logprobs(batch).logprobs.float().cpu()
        m_T = (batch.loss_mask > 0).float().cpu()
        nll -= float((logp_T * m_T).sum())
        count += float(m_T.sum())
    return {"eval/loss": nll / count, "eval/assistant_tokens": count}
