"""OpenAI chat messages <-> the policy's token ids: rendering with the chat template, tool
definitions, and tool calls parsed out of sampled text.

Tool calls and reasoning are parsed in the format of the model's family
(:mod:`rl_agents.parsers`: Hermes/Qwen, Qwen3-Coder, Llama 3.x, Mistral, DeepSeek), chosen by
``ChatFormat.Config.family`` or detected from the chat template. The Hermes / Qwen convention,
the one the server writes itself for a template that does not render tools, is one block per
call::

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rl_agents.parsers import FAMILIES, ParsedCompletion, ResponseFormat, ToolCall, response_format
from rl_core.errors import ConfigError, DataError
from rl_core.interfaces import Tokenizer

__all__ = ["ChatFormat", "ParsedCompletion", "ToolCall"]

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou can call the functions described below. Each is a JSON schema inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a JSON object "
    "with its name and arguments between <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


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
        family: str = "auto"
        """The model family whose tool-call and reasoning format completions are parsed in
        (:data:`rl_agents.parsers.FAMILIES`: ``hermes``, ``qwen3_coder``, ``llama3``,
        ``mistral``, ``deepseek``); ``auto``: detected from the chat template (``hermes`` for a
        template that does not render tools)."""

        def __post_init__(self) -> None:
            if self.family != "auto" and self.family not in FAMILIES:
                response_format(self.family)  # the ConfigError naming the known families
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
        try:
            import transformers.utils.chat_parsing  # noqa: F401  (the parser of every family)
        except ImportError as e:
            raise ConfigError(
                "agents: parsing tool calls and reasoning needs transformers>=5.24 "
                f"(transformers.utils.chat_parsing: {e}); pip install 'transformers>=5.24,<6'."
            ) from e
        self.format: ResponseFormat = response_format(
            self.config.family, str(template), native_tools=self.native_tools
        )
        """The family's tool-call and reasoning format (:mod:`rl_agents.parsers`)."""
        if not self.native_tools and self.format.name != "hermes":
            raise ConfigError(
                f"agents.chat.family: {self.format.name!r} needs a chat template that renders "
                "tools itself (the server writes tools and calls in Hermes format otherwise); "
                "use the model's own template, or family hermes."
            )
        self.thinking_switch: str | None = next(
            (k for k in ("enable_thinking", "thinking") if k in str(template)), None
        )
        """The template variable that turns reasoning on or off (Qwen3 ``enable_thinking``,
        DeepSeek-V3.1 ``thinking``), ``None`` when the template has none."""
        specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials |= {str(t) for t in added.values() if getattr(t, "special", False)}
        self._specials = tuple(sorted((t for t in specials if t), key=len, reverse=True))

    # ----------------------------------------------------------------------------- render
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        thinking: bool | None = None,
    ) -> str:
        """The prompt text of ``messages`` (OpenAI format) with a generation prompt.
        ``thinking`` (not ``None``) sets the template's thinking switch
        (:attr:`thinking_switch`, which must exist then).

        Raises DataError naming the message index when a message is malformed.
        """
        msgs = [self._message(i, m) for i, m in enumerate(messages)]
        kwargs = dict(self.config.template_kwargs)
        if thinking is not None and self.thinking_switch is not None:
            kwargs[self.thinking_switch] = thinking
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
    def parse_completion(
        self,
        text: str,
        *,
        prompt: str = "",
        tools_enabled: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedCompletion:
        """Split a completion's text (decoded with its special tokens, without the final stop
        token) into content, reasoning and tool calls in the family's format (arguments
        written as text cast to the ``tools``' schemas); special tokens are removed from the
        content and reasoning returned."""
        return self.format.parse(
            text,
            prompt=prompt,
            tools_enabled=tools_enabled,
            tools=tools,
            clean=self._strip_specials,
        )

    def _strip_specials(self, text: str) -> str:
        for t in self._specials:
            if t in text:
                text = text.replace(t, "")
        return text

    @staticmethod
    def parse(text: str, *, tools_enabled: bool = True) -> ParsedCompletion:
        """Split sampled text into content and tool calls in the Hermes format (see the module
        docstring); :meth:`parse_completion` parses in the configured family's format."""
        return FAMILIES["hermes"].parse(text, tools_enabled=tools_enabled)


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
