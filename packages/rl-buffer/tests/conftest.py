"""Shared fixtures: a locally built tokenizer (no downloads) and JSONL writers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


class CharTokenizer:
    """A hand-made tokenizer: one id per character (``ord % 1000``), BOS = 1000, a ChatML-like
    template. Counts template calls so tests can check the kwargs that reached it."""

    eos_token_id = 1001
    pad_token_id = 1002

    def __init__(self) -> None:
        self.template_calls: list[dict[str, Any]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) % 1000 for c in text]
        return [1000, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i < 1000)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
        self.template_calls.append(kw)
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if kw.get("tools"):
            text = f"<tools>{json.dumps(kw['tools'])}\n" + text
        if kw.get("enable_thinking") is False:
            text += "<nothink>"
        return text + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The byte-level ChatML tokenizer of rl_hf (built locally)."""
    pytest.importorskip("transformers")
    from rl_hf.tokenizer import build_tokenizer

    return build_tokenizer()


def _write_jsonl(path: Path, records: list[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, records)``: records are dicts (dumped) or raw strings (written as is)."""
    return _write_jsonl


@pytest.fixture
def text_group():
    """A function ``(uid, responses, label="ab") -> Group``: one prompt (token 1) whose rollouts
    respond with the given strings, one token per character (``ord``; see ``char_tokenizer``)."""
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
