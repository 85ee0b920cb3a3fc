"""RewardModel: a transformers sequence classifier (one score per text) as a batched reward.

A reward model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` (the head of a
Bradley-Terry reward model, e.g. Skywork-Reward, ArmoRM's scalar head): its score of
``prompt + response`` is the reward. In a recipe, alone or next to rule rewards::

    reward:
      type: combine
      components:
        rm:      {reward: {type: reward_model, path: models/rm, batch_size: 64}, weight: 0.5}
        correct: {reward: {type: exact_match}, weight: 1.0}

The text scored is the chat of the prompt's messages plus the response as the assistant turn,
through the reward model's own chat template, when the prompt is chat messages and the
tokenizer has a template; otherwise the prompt text followed by the response
(``Config.separator`` between them). The reward model has its own tokenizer: it never sees the
policy's token ids.

Batching: the reward is async. Every call made while the event loop is busy (the trainer's
scorer starts all of a round's rollouts at once, and :class:`~rl_core.rewards.combine.Combine`
its components) joins one pending batch; the batch runs as forwards of at most
``batch_size`` texts in a worker thread (the event loop keeps serving generation), and each
call gets its own score. A forward that fails fails every call of its batch (the trainer counts
them as reward failures). On the ``ray`` runtime rewards run in the driver, so the reward model
does too (on ``device``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rl_core.config import PositiveInt
from rl_core.errors import ConfigError
from rl_core.types import Prompt, Rollout

__all__ = ["RewardModel"]


class RewardModel:
    """A sequence-classifier reward model (see the module docstring). Registered as the reward
    ``reward_model``; async: each call returns a coroutine of the float score."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`RewardModel`."""

        path: str
        """Hugging Face directory of the reward model (``config.json`` with one label,
        weights, tokenizer files)."""
        batch_size: PositiveInt = 32
        """Texts per forward."""
        max_length: PositiveInt = 2048
        """Longer texts are cut to their last this-many tokens (the response end is kept)."""
        device: str = "cpu"
        """Torch device of the model."""
        dtype: Literal["float32", "bfloat16"] = "float32"
        """Parameter dtype (scores are returned as float32)."""
        separator: str = ""
        """Between the prompt text and the response when no chat template is used."""

    def __init__(self, config: Config) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rl_hf._hf import quiet_progress

        self.config = config
        """The settings (read-only)."""
        path = Path(config.path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"reward.path: {config.path!r} has no config.json; point it at a Hugging Face "
                "sequence-classification model directory (num_labels=1)."
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        """The reward model's own tokenizer."""
        with quiet_progress():
            model = AutoModelForSequenceClassification.from_pretrained(
                str(path), dtype=getattr(torch, config.dtype)
            )
        if model.config.num_labels != 1:
            raise ConfigError(
                f"reward.path: {config.path!r} is a classifier with {model.config.num_labels} "
                "labels; a reward model has one (num_labels=1)."
            )
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ConfigError(
                f"reward.path: the tokenizer in {config.path!r} has neither a pad nor an EOS "
                "token; add a pad token to it."
            )
        self._pad = int(pad)
        model.config.pad_token_id = self._pad  # the head pools at the last non-pad token
        self.model = model.to(config.device).eval()
        """The ``transformers`` sequence classifier (eval mode)."""
        self.forward_sizes: list[int] = []
        """Texts in each forward run so far (how the calls were batched)."""
        self._pending: list[tuple[str, asyncio.Future[float]]] = []
        self._flush_scheduled = False

    # ------------------------------------------------------------------ scoring
    def text(self, prompt: Prompt, response: str) -> str:
        """The text the reward model scores for ``response`` to ``prompt``."""
        if isinstance(prompt.input, list) and getattr(self.tokenizer, "chat_template", None):
            chat = [*prompt.input, {"role": "assistant", "content": response}]
            return str(self.tokenizer.apply_chat_template(chat, tokenize=False))
        if isinstance(prompt.input, list):
            prompt_text = "\n".join(str(m.get("content", "")) for m in prompt.input)
        else:
            prompt_text = prompt.input
        return f"{prompt_text}{self.config.separator}{response}"

    def score_texts(self, texts: list[str]) -> list[float]:
        """Scores of ``texts``, ``batch_size`` per forward (synchronous)."""
        out: list[float] = []
        for i in range(0, len(texts), self.config.batch_size):
            out.extend(self._forward(texts[i : i + self.config.batch_size]))
        return out

    def _forward(self, texts: list[str]) -> list[float]:
        self.forward_sizes.append(len(texts))
        ids = [self._ids(t) for t in texts]
        width = max(len(x) for x in ids)
        input_BL = torch.full((len(ids), width), self._pad, dtype=torch.long)
        mask_BL = torch.zeros((len(ids), width), dtype=torch.long)
        for b, x in enumerate(ids):  # right padding: causal positions of each text unchanged
            input_BL[b, : len(x)] = torch.tensor(x)
            mask_BL[b, : len(x)] = 1
        device = self.model.device
        with torch.no_grad():
            logits_B1 = self.model(
                input_ids=input_BL.to(device), attention_mask=mask_BL.to(device)
            ).logits
        return [float(v) for v in logits_B1[:, 0].float().cpu()]

    def _ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        if not ids:
            raise ConfigError("reward_model: an empty text has no token to score.")
        ids = ids[-self.config.max_length :]
        # the head pools at the last non-pad token: a text ending in the pad id would be cut
        while len(ids) > 1 and ids[-1] == self._pad:
            ids.pop()
        return ids

    async def __call__(
        self, prompt: Prompt, response: str, rollout: Rollout | None = None
    ) -> float:
        """The score of ``response`` to ``prompt``, batched with the calls made meanwhile."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[float] = loop.create_future()
        self._pending.append((self.text(prompt, response), future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(lambda: loop.create_task(self._flush()))
        return await future

    async def _flush(self) -> None:
        """Score every pending call (the calls started in this loop turn)."""
        await asyncio.sleep(0)  # let calls started in the same turn join
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        try:
            scores = await asyncio.to_thread(self.score_texts, [t for t, _ in pending])
        except Exception as e:  # every call of the batch fails with the cause
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), score in zip(pending, scores, strict=True):
            if not fut.done():
                fut.set_result(score)
