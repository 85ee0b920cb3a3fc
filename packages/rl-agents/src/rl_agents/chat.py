"""OpenAI chat messages <-> the policy's token ids: rendering with the chat template, tool
definitions, and tool calls parsed out of sampled text.

Tool calls use the Hermes / Qwen convention: the model writes one block per call::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

:meth:`ChatFormat.parse` turns a completion's text into OpenAI ``content`` + ``tool_calls``, and
:meth:`ChatFormat.render` turns a request's messages (with ``tools``) into the prompt text the
policy's chat template produces. When the template does not mention ``tools`` (the built-in
ChatML template of :func:`rl_hf.build_tokenizer`), the tool list is written into the
system message and assistant tool calls are written back as ``<tool_call>`` blocks, so any
tokenizer with a chat template works.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rl_core.errors import ConfigError, DataError
from rl_core.interfaces import Tokenizer

__all__ = ["ChatFormat", "ParsedCompletion", "ToolCall"]

_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou can call the functions described below. Each is a JSON schema inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a JSON object "
    "with its name and arguments between <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


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
    """Text outside tool-call blocks (``None`` when there is only whitespace besides calls)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Parsed calls, in order."""
    ill_formed: bool = False
    """A ``<tool_call>`` block was present but not valid JSON with a ``name``: the whole text
    is returned as content and no call is made."""


class ChatFormat:
    """Renders chat messages with a tokenizer's template and parses tool calls."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`ChatFormat`."""

        tools_in_template: Literal["auto", "always", "never"] = "auto"
        """Pass ``tools`` and structured tool calls to the chat template (``always``), or write
        them as text (``never``: tool list in the system message, calls as ``<tool_call>``
        blocks). ``auto``: native when the template's source mentions ``tools``."""
        template_kwargs: dict[str, Any] = field(default_factory=dict)
        """Extra keyword arguments for ``apply_chat_template`` (e.g. ``enable_thinking``)."""

        def __post_init__(self) -> None:
            if self.tools_in_template not in ("auto", "always", "never"):
                raise ConfigError(
                    "agents.chat.tools_in_template: expected auto, always or never, got "
                    f"{self.tools_in_template!r}."
                )

    def __init__(self, tokenizer: Tokenizer, config: Config | None = None) -> None:
        self.config = config or ChatFormat.Config()
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not template or not hasattr(tokenizer, "apply_chat_template"):
            raise ConfigError(
                "agents: the policy tokenizer has no chat template; set one "
                "(tokenizer.chat_template = ...) before serving chat completions."
            )
        mode = self.config.tools_in_template
        self.native_tools = mode == "always" or (mode == "auto" and "tools" in str(template))
        """True when tools and tool calls are passed to the template itself."""

    # ----------------------------------------------------------------------------- render
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of ``messages`` (OpenAI format) with a generation prompt.

        Raises DataError naming the message index when a message is malformed.
        """
        msgs = [self._message(i, m) for i, m in enumerate(messages)]
        kwargs = dict(self.config.template_kwargs)
        if tools:
            if self.native_tools:
                kwargs["tools"] = [dict(t) for t in tools]
            else:
                preamble = _TOOLS_PREAMBLE.format(
                    tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
                )
                if msgs and msgs[0]["role"] == "system":
                    msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{preamble}"}
                else:
                    msgs.insert(0, {"role": "system", "content": preamble})
        try:
            text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # template errors are user-data errors
            raise DataError(f"messages: the chat template failed on them: {e}") from e
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (the template wrote the special tokens itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _message(self, i: int, m: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(m, Mapping) or "role" not in m:
            raise DataError(f"messages[{i}]: expected an object with a 'role', got {m!r}.")
        role = str(m["role"])
        content = _text(m.get("content"), f"messages[{i}].content")
        calls = m.get("tool_calls") or []
        if role != "assistant" or not calls:
            out: dict[str, Any] = {"role": role, "content": content}
            if role == "tool" and m.get("tool_call_id") is not None:
                out["tool_call_id"] = m["tool_call_id"]
            return out
        parsed = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(fn, Mapping) or "name" not in fn:
                raise DataError(
                    f"messages[{i}].tool_calls[{j}]: expected "
                    "{'type': 'function', 'function': {'name': ..., 'arguments': '...'}}."
                )
            args = fn.get("arguments") or "{}"
            try:
                args_obj = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError as e:
                raise DataError(
                    f"messages[{i}].tool_calls[{j}].function.arguments: not JSON ({e})."
                ) from None
            parsed.append((str(fn["name"]), args_obj, c.get("id")))
        if self.native_tools:
            return {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                    for n, a, cid in parsed
                ],
            }
        blocks = "\n".join(
            "<tool_call>\n"
            + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
            + "\n</tool_call>"
            for n, a, _ in parsed
        )
        return {"role": "assistant", "content": f"{content}\n{blocks}" if content else blocks}

    # ----------------------------------------------------------------------------- parse
    @staticmethod
    def parse(text: str, *, tools_enabled: bool = True) -> ParsedCompletion:
        """Split sampled text into content and tool calls (see the module docstring)."""
        if not tools_enabled or "<tool_call>" not in text:
            return ParsedCompletion(content=text)
        calls = []
        for block in _TOOL_BLOCK.findall(text):
            try:
                obj = json.loads(block)
            except json.JSONDecodeError:
                return ParsedCompletion(content=text, ill_formed=True)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ParsedCompletion(content=text, ill_formed=True)
            args = obj.get("arguments", {})
            calls.append(
                ToolCall(
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    name=obj["name"],
                    arguments=args if isinstance(args, str) else json.dumps(args),
                )
            )
        if not calls:  # an opening tag without a complete block
            return ParsedCompletion(content=text, ill_formed=True)
        rest = _TOOL_BLOCK.sub("", text).strip()
        return ParsedCompletion(content=rest or None, tool_calls=tuple(calls))


def _text(content: Any, where: str) -> str:
    """OpenAI content (a string, ``None``, or a list of ``{"type": "text"}`` parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, p in enumerate(content):
            if not isinstance(p, Mapping) or p.get("type") != "text":
                raise DataError(
                    f"{where}[{k}]: only text parts are supported, got "
                    f"{p.get('type') if isinstance(p, Mapping) else p!r}."
                )
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise DataError(f"{where}: expected a string or a list of text parts, got {content!r}.")
