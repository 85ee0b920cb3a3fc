"""Tool-call and reasoning formats per model family, parsed by transformers' response parser.

A model writes its tool calls and its reasoning in the format its chat template taught it. Each
:class:`ResponseFormat` here is a *response template* in transformers' declarative format (the
``response_template`` of transformers' ``tokenizer.parse_response``), run by transformers' own
streaming ``transformers.utils.chat_parsing.ResponseParser``: no
hand-written parsing loop. The Hermes/Qwen and Qwen3-Coder templates are transformers' own
(``transformers/cli/serving/utils.py``, 5.24); the Llama 3.x, Mistral and DeepSeek ones are
written in the same format after SGLang's function-call detectors (``llama32``, ``mistral``,
``deepseekv3``) and checked against completions rendered by each family's own chat template
(``tests/fixtures/chat_families.json``).

=============  ===========================================================  ==================
family         tool calls                                                    reasoning
=============  ===========================================================  ==================
``hermes``     ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``   ``<think>...</think>``
               (Qwen2.5, Qwen3, Hermes; the built-in ChatML fallback)        (Qwen3)
``qwen3_coder`` ``<tool_call><function=NAME><parameter=K>V</parameter>...``  ``<think>...</think>``
``llama3``     ``{"name": ..., "parameters": {...}}`` (optionally after      none
               ``<|python_tag|>``, several separated by ``;``)
``mistral``    ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``      none
``deepseek``   ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a json    ``<think>...</think>``
               block (V3, R1)                                                (R1)
``glm``        ``<tool_call>NAME`` + ``<arg_key>K</arg_key><arg_value>V``     ``<think>...</think>``
               ``</arg_value>`` pairs (GLM-4.5, 4.6)
``kimi_k2``    ``<|tool_call_begin|>functions.NAME:i<|tool_call_argument_``   ``<think>...</think>``
               ``begin|>{json}<|tool_call_end|>`` (Kimi K2, K2-Thinking)     (K2-Thinking)
=============  ===========================================================  ==================

Arguments written as text (Qwen3-Coder, GLM) are cast with the request's tool schemas
(``"2"`` becomes ``2`` for an integer parameter), as transformers' parser does.

:func:`response_format` picks one by name, or (``"auto"``) from the chat template's source.
The prompt the completion continues is passed to the parser, so a template that opens the
reasoning in the prompt (DeepSeek-R1's ``<think>\\n``, Qwen3's empty ``<think></think>`` when
thinking is off) is parsed right.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

from rl_core.errors import ConfigError

__all__ = [
    "FAMILIES",
    "ParsedCompletion",
    "ResponseFormat",
    "ToolCall",
    "detect_family",
    "response_format",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call parsed from a completion, in OpenAI's shape."""

    id: str
    """Call id the client echoes back in the ``tool`` message (``call_<hex>``)."""
    name: str
    """Function name."""
    arguments: str
    """Arguments as a JSON string (OpenAI's encoding)."""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The ``tool_calls[i]`` object of a response (with ``index`` for stream deltas)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True, slots=True)
class ParsedCompletion:
    """A completion's text split into what an OpenAI client sees."""

    content: str | None
    """Text outside tool calls and reasoning (``None`` when there is only whitespace besides
    calls)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Parsed calls, in order."""
    ill_formed: bool = False
    """A tool call was begun but is not valid (not JSON, no ``name``): the whole text is
    returned as content and no call is made."""
    reasoning: str | None = None
    """The model's reasoning (``<think>`` text), returned as ``reasoning_content`` / a
    ``thinking`` block / a ``reasoning`` item; ``None`` when it wrote none."""


_THINK = {"open": "<think>", "close": "</think>", "content": "text"}


def _hermes_template() -> dict[str, Any]:
    # transformers 5.24, cli/serving/utils.py _RESPONSE_TEMPLATE_FALLBACKS["qwen3", ...]
    # (tests/test_chat_families.py checks this copy against transformers' own).
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": dict(_THINK),
            "tool_calls": {
                "open_pattern": r"\s*<tool_call>",
                "close": "</tool_call>",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {
                "close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>)",
                "content": "text",
            },
        },
    }


def _qwen3_coder_template() -> dict[str, Any]:
    # transformers 5.24, cli/serving/utils.py _RESPONSE_TEMPLATE_FALLBACKS["qwen3_5", ...]
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": dict(_THINK),
            "tool_calls": {
                "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
                "close_pattern": r"</function>\s*</tool_call>",
                "repeats": True,
                "content": "xml-inline",
                "content_args": {
                    "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                },
                "transform": {
                    "type": "function",
                    "function": {"name": "{name}", "arguments": "{content}"},
                },
            },
            "content": {
                "close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)",
                "content": "text",
            },
        },
    }


def _llama3_template() -> dict[str, Any]:
    # After SGLang's Llama32Detector: a call is a JSON object with "name" at the start of the
    # message or after <|python_tag|>; several calls are separated by ";".
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "fields": {
            "tool_calls": {
                "open_pattern": r'(?:^|<\|python_tag\|>|(?<=;))\s*(?=\{\s*"name")',
                "close_pattern": r"\s*(?:;|<\|eom_id\|>|<\|eot_id\|>)",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {
                "close_pattern": r"\s*(?:<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)",
                "content": "text",
            },
        },
    }


def _mistral_template() -> dict[str, Any]:
    # After SGLang's MistralDetector (pre-v11 tokenizers): "[TOOL_CALLS] [" + a JSON array.
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "[/INST]",
        "fields": {
            "tool_calls": {
                "open_pattern": r"\s*\[TOOL_CALLS\]\s*(?=\[)",
                "close_pattern": r"\s*</s>",
                "content": "json",
            },
            "content": {"close_pattern": r"\s*</s>", "content": "text"},
        },
    }


def _glm_template() -> dict[str, Any]:
    # After SGLang's Glm4MoeDetector: <tool_call>NAME then <arg_key>/<arg_value> pairs.
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|assistant|>",
        "fields": {
            "reasoning_content": dict(_THINK),
            "tool_calls": {
                "open_pattern": r"\s*<tool_call>\s*(?P<name>[\w.\-]+)\s*(?=\n|<)",
                "close": "</tool_call>",
                "repeats": True,
                "content": "xml-inline",
                "content_args": {
                    "tag_pattern": (
                        r"<arg_key>\s*(?P<key>.*?)\s*</arg_key>\s*"
                        r"<arg_value>(?P<value>.*?)</arg_value>"
                    ),
                },
                "transform": {
                    "type": "function",
                    "function": {"name": "{name}", "arguments": "{content}"},
                },
            },
            "content": {
                "close_pattern": r"\s*(?:<\|user\|>|<\|observation\|>|<\|endoftext\|>)",
                "content": "text",
            },
        },
    }


def _kimi_k2_template() -> dict[str, Any]:
    # After SGLang's KimiK2Detector: the call id "functions.NAME:i" carries the name.
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_assistant|>assistant<|im_middle|>",
        "fields": {
            "reasoning_content": dict(_THINK),
            "tool_calls": {
                "open_pattern": (
                    r"\s*(?:<\|tool_calls_section_begin\|>)?\s*<\|tool_call_begin\|>\s*"
                    r"(?:functions\.)?(?P<name>[\w.\-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>"
                ),
                "close_pattern": r"\s*<\|tool_call_end\|>\s*(?:<\|tool_calls_section_end\|>)?",
                "repeats": True,
                "content": "json",
                "transform": {
                    "type": "function",
                    "function": {"name": "{name}", "arguments": "{content}"},
                },
            },
            "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
        },
    }


def _deepseek_template() -> dict[str, Any]:
    # After SGLang's DeepSeekV3Detector: <｜tool▁calls▁begin｜> then per call
    # <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>.
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<｜Assistant｜>",
        "fields": {
            "reasoning_content": dict(_THINK),
            "tool_calls": {
                "open_pattern": (
                    r"\s*(?:<｜tool▁calls▁begin｜>)?\s*<｜tool▁call▁begin｜>\w+<｜tool▁sep｜>"
                    r"(?P<name>[^\n]+)\n```json\n"
                ),
                "close_pattern": r"\n```\s*<｜tool▁call▁end｜>\s*(?:<｜tool▁calls▁end｜>)?",
                "repeats": True,
                "content": "json",
                "transform": {
                    "type": "function",
                    "function": {"name": "{name}", "arguments": "{content}"},
                },
            },
            "content": {"close_pattern": r"\s*<｜end▁of▁sentence｜>", "content": "text"},
        },
    }


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """How one model family writes tool calls and reasoning (see the module docstring)."""

    name: str
    """Family name (``agents.chat.family``)."""
    template: Mapping[str, Any]
    """The transformers response template."""
    markers: tuple[str, ...]
    """Strings of a chat template's source that identify the family (any one suffices)."""
    triggers: tuple[str, ...] = field(default=())
    """Strings whose presence in a completion (or an open reasoning in the prompt) makes it
    worth parsing; a completion without any is plain content."""

    @property
    def reasoning(self) -> bool:
        """The family writes reasoning (``<think>``)."""
        return "reasoning_content" in self.template["fields"]

    def parse(
        self,
        text: str,
        *,
        prompt: str = "",
        tools_enabled: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        clean: Any = None,
    ) -> ParsedCompletion:
        """Split completion ``text`` (special tokens kept) into content, reasoning and tool
        calls. ``prompt`` is the rendered prompt it continues; ``tools`` (OpenAI tool
        definitions) cast arguments written as text to their schema's types; ``clean`` removes
        special tokens from the returned content and reasoning. A call that does not parse
        makes the whole (cleaned) text the content, with ``ill_formed`` set."""
        from transformers.utils.chat_parsing import ResponseParser

        clean = clean or (lambda s: s)
        tail = prompt[-64:]
        opened = self.reasoning and tail.rfind("<think>") > tail.rfind("</think>")
        if not opened and not any(t in text for t in self.triggers):
            return ParsedCompletion(content=clean(text))
        template = deepcopy(dict(self.template))
        if not tools_enabled:
            template["fields"] = {k: v for k, v in template["fields"].items() if k != "tool_calls"}
        # The parser's message keeps only the last region of a field (an empty content region
        # after the calls would erase the text before them), so the closed regions are read
        # from its events instead.
        values: dict[str, list[Any]] = {"content": [], "reasoning_content": [], "tool_calls": []}
        anchor = template["start_anchor"]
        anchors = [anchor] if isinstance(anchor, str) else list(anchor)
        if not any(a in prompt for a in anchors):
            # The parser would read the whole prompt as the message; only say whether the
            # prompt left the reasoning open.
            prompt = "<think>\n" if opened else ""
        try:
            # Only arguments written as text are cast; JSON arguments keep the model's types.
            as_text = template["fields"].get("tool_calls", {}).get("content") != "json"
            schemas = [dict(t) for t in tools or []] if as_text else []
            parser = ResponseParser(template, prefix=prompt, tools=schemas or None)
            events = [*parser.initial_events, *parser.feed(text), *parser.finalize()[1]]
            for e in events:
                if e.get("type") == "region_close" and e.get("field") in values:
                    values[e["field"]].append(e.get("value"))
            calls = tuple(_calls(values["tool_calls"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            return ParsedCompletion(content=clean(text), ill_formed=True)
        parts = [clean(v) for v in values["content"] if isinstance(v, str) and v.strip()]
        content = "\n".join(parts) if parts else None
        thoughts = [clean(v).strip() for v in values["reasoning_content"] if isinstance(v, str)]
        reasoning = "\n".join(t for t in thoughts if t) or None
        if content is None and not calls and reasoning is None:
            content = clean(text).strip() or None
        return ParsedCompletion(content=content, tool_calls=calls, reasoning=reasoning)


def _calls(value: Any) -> list[ToolCall]:
    """OpenAI tool calls from the parser's ``tool_calls`` value (a list of ``{"type":
    "function", "function": {...}}`` or of bare ``{"name", "arguments"|"parameters"}``)."""
    if value is None:
        return []
    items: list[Any] = []
    for v in value if isinstance(value, list) else [value]:
        items.extend(v if isinstance(v, list) else [v])
    out = []
    for item in items:
        fn = item.get("function", item) if isinstance(item, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool call without a name: {item!r}")
        args = fn.get("arguments", fn.get("parameters", {}))
        out.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                name=fn["name"].strip(),
                arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
            )
        )
    return out


FAMILIES: dict[str, ResponseFormat] = {
    f.name: f
    for f in (
        ResponseFormat(
            "glm",
            _glm_template(),
            markers=("<arg_key>",),
            triggers=("<tool_call>", "<think>", "</think>"),
        ),
        ResponseFormat(
            "kimi_k2",
            _kimi_k2_template(),
            markers=("<|tool_calls_section_begin|>", "<|im_assistant|>"),
            triggers=("<|tool_call_begin|>", "<think>", "</think>"),
        ),
        ResponseFormat(
            "qwen3_coder",
            _qwen3_coder_template(),
            markers=("<function=",),
            triggers=("<tool_call>", "<think>", "</think>"),
        ),
        ResponseFormat(
            "hermes",
            _hermes_template(),
            markers=("<tool_call>", "<|im_start|>"),
            triggers=("<tool_call>", "<think>", "</think>"),
        ),
        ResponseFormat(
            "deepseek",
            _deepseek_template(),
            markers=("<｜tool▁calls▁begin｜>", "<｜Assistant｜>"),
            triggers=("<｜tool▁call▁begin｜>", "<think>", "</think>"),
        ),
        ResponseFormat(
            "mistral",
            _mistral_template(),
            markers=("[TOOL_CALLS]", "[INST]"),
            triggers=("[TOOL_CALLS]",),
        ),
        ResponseFormat(
            "llama3",
            _llama3_template(),
            markers=("<|start_header_id|>",),
            triggers=('{"name"', "<|python_tag|>", '{ "name"'),
        ),
    )
}
"""The known families by name, in the order :func:`detect_family` tries them."""


def detect_family(chat_template: str) -> str | None:
    """The family whose markers the chat template's source contains (first match in
    :data:`FAMILIES` order), or ``None``."""
    for f in FAMILIES.values():
        if any(m in chat_template for m in f.markers):
            return f.name
    return None


def response_format(
    name: str, chat_template: str = "", *, native_tools: bool = True
) -> ResponseFormat:
    """The :class:`ResponseFormat` called ``name``, or for ``"auto"`` the one detected from
    ``chat_template`` (``hermes`` when the template does not render tools itself: the server
    then writes the tool list and calls in Hermes format).

    Raises:
        ConfigError: an unknown name, or ``auto`` with a tool-rendering template of no known
            family (naming the families to choose from).
    """
    known = ", ".join(FAMILIES)
    if name == "auto":
        found = detect_family(chat_template)
        if found is None and not native_tools:
            found = "hermes"
        if found is None:
            raise ConfigError(
                "agents.chat.family: auto could not tell the tool-call format from the chat "
                f"template (none of its markers found); set agents.chat.family to one of: {known}."
            )
        return FAMILIES[found]
    if name not in FAMILIES:
        raise ConfigError(
            f"agents.chat.family: unknown model family {name!r}; expected auto or one of: {known}."
        )
    return FAMILIES[name]
