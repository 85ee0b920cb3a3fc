"""Checks at load of what the model itself cannot honour, before any model is built.

The model's ``config.json`` (``model.path``, or the tiny model ``model.init`` builds) says what
the run can ask of it:

- :func:`check_routing`: ``rollout.routing_replay`` needs a mixture-of-experts model (before,
  a dense one was refused only when the first generation came back without routing);
- :func:`check_context`: every prompt the run will sample, plus the response budget
  (``rollout.sampling.max_new_tokens``, or an eval set's own), fits the model's context
  (``max_position_embeddings`` or the equivalent key of the architecture). Not the tokenizer's
  ``model_max_length``, which is often a placeholder (1,048,576) far above the real context:
  a long row passed and ended the run at the first RL step that drew it. The first offending
  row is named by file and line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_core.errors import ConfigError
from rl_core.types import Prompt

__all__ = ["CONTEXT_KEYS", "check_context", "check_routing", "model_context", "read_model_config"]

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Keys of a model's ``config.json`` that give its context length, in the order tried."""

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def read_model_config(model_path: str | Path) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (``{}`` when there is none, e.g. a GGUF file)."""
    p = Path(model_path) / "config.json"
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: cannot read the model's config ({e}); check model.path.") from None
    return data if isinstance(data, dict) else {}


def _sections(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The config and its language-model part (``text_config`` of multimodal models)."""
    text = config.get("text_config")
    return [config, text] if isinstance(text, Mapping) else [config]


def model_context(config: Mapping[str, Any]) -> tuple[int, str] | None:
    """``(context length, key)`` from a model config, or ``None`` when it names none."""
    for section in _sections(config):
        for key in CONTEXT_KEYS:
            v = section.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v, key
    return None


def check_routing(mode: str, config: Mapping[str, Any], model_path: str) -> None:
    """Refuse ``rollout.routing_replay`` other than ``off`` on a model without experts."""
    if mode == "off" or not config:
        return
    for section in _sections(config):
        for key in _EXPERT_KEYS:
            v = section.get(key)
            if isinstance(v, int) and v > 1:
                return
    raise ConfigError(
        f"rollout.routing_replay: {mode!r} needs a mixture-of-experts model, and "
        f"{model_path} (model_type {config.get('model_type')!r}) is dense: its config.json "
        f"has none of {', '.join(_EXPERT_KEYS)}. Set rollout.routing_replay: off, or use a "
        "mixture-of-experts model."
    )


def check_context(
    config: Mapping[str, Any],
    model_path: str,
    sets: Sequence[tuple[str, Any, Sequence[Prompt] | None, int, str]],
) -> None:
    """Refuse prompts that cannot fit the model's context with their response budget.

    ``sets``: ``(field, source, prompts, max_new_tokens, budget_field)`` per data set; the
    prompts are ``prompts`` when given (an eval set's fixed ones), else every prompt of
    ``source`` (read without moving its cursor). Raises a :class:`ConfigError` naming the
    first offending row's file and line, how many rows are too long and the fixes."""
    found = model_context(config)
    if found is None:
        return
    context, key = found
    for field, source, prompts, max_new, budget_field in sets:
        rows = list(prompts) if prompts is not None else _all_prompts(source)
        limit = context - max_new
        bad = [p for p in rows if len(p.token_ids) > limit]
        if not bad:
            continue
        first = min(bad, key=lambda p: (str(p.metadata.get("source")), _row(p)))
        where = _location(source, first)
        raise ConfigError(
            f"{field}: {len(bad)} of {len(rows)} prompts do not fit the model's context with "
            f"the response budget: {where} has {len(first.token_ids)} prompt tokens, + "
            f"{budget_field} = {max_new} > {context} ({key} of {model_path}/config.json). "
            f"Drop them with the data source's max_prompt_tokens: {max(limit, 1)}, shorten "
            f"those rows, or lower {budget_field}."
        )


def _row(p: Prompt) -> int:
    row = p.metadata.get("row")
    return row if isinstance(row, int) else 0


def _all_prompts(source: Any) -> list[Prompt]:
    """Every prompt of ``source`` once, its cursor (``state_dict``) left where it was (a
    mixture's: every prompt of each member)."""
    members = getattr(source, "sources", None)
    if isinstance(members, list) and members:
        return [p for m in members for p in _all_prompts(m)]
    try:
        n = len(source)
        state = source.state_dict()
    except (TypeError, AttributeError, NotImplementedError):
        return []  # a source that cannot be read twice is checked when it is drawn
    try:
        return list(source.next_prompts(n))
    finally:
        source.load_state_dict(state)


def _location(source: Any, p: Prompt) -> str:
    """``file:line`` of prompt ``p`` when ``source`` is a JSONL file, else ``file row N`` or
    the prompt's uid."""
    row = p.metadata.get("row")
    file = _file_of(source, p)
    if file is None or not isinstance(row, int):
        return f"prompt {p.uid}"
    if file.suffix == ".jsonl" and file.is_file():
        n = -1
        with file.open(encoding="utf-8-sig", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    n += 1
                    if n == row:
                        return f"{file}:{lineno}"
    return f"{file} row {row}"


def _file_of(source: Any, p: Prompt) -> Path | None:
    """The file ``p`` was read from: ``source.file``, or the mixture member it names."""
    file = getattr(source, "file", None)
    if file is not None:
        return Path(file)
    for member in getattr(source, "sources", None) or []:
        if getattr(member, "name", None) == p.metadata.get("source"):
            return _file_of(member, p)
    return None
