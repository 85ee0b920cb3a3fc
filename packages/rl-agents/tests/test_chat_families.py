"""Tool-call and reasoning parsing per model family (rl_agents.parsers) on completions rendered
by each family's own chat template (tests/fixtures/chat_families.json names each template's
source), family selection, and the Hermes template kept equal to transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_agents.chat import ChatFormat
from rl_agents.parsers import FAMILIES, detect_family, response_format
from rl_core.errors import ConfigError

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "chat_families.json").read_text())
CASES = FIXTURES["families"]


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_family_parses_calls_rendered_by_its_own_template(family):
    case = CASES[family]
    parsed = FAMILIES[family].parse(
        case["completion"], prompt=case["prompt"], tools=case.get("tools")
    )
    assert not parsed.ill_formed
    got = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in parsed.tool_calls]
    assert got == case["expected"]["tool_calls"]  # GLM's "2" cast to 2 by the tool schema
    assert parsed.content == case["expected"]["content"]
    assert parsed.reasoning == case["expected"].get("reasoning")
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize("family", sorted(CASES))
def test_other_families_do_not_take_a_familys_calls(family):
    """A family's completion parsed in another family's format yields no calls: the formats
    are told apart, so picking the right family matters."""
    case = CASES[family]
    for other in CASES:
        if other != family:
            assert FAMILIES[other].parse(case["completion"], prompt="").tool_calls == ()


@pytest.mark.parametrize(
    ("family", "prompt", "text"),
    [
        ("hermes", "<|im_start|>assistant\n", "<think>\nadd them\n</think>\n\n5"),
        ("hermes", "<|im_start|>assistant\n<think>\n", "add them\n</think>\n\n5"),
        ("deepseek", "<｜User｜>2+3<｜Assistant｜><think>\n", "add them\n</think>\n\n5"),
        ("deepseek", "<｜User｜>2+3<｜Assistant｜>", "<think>add them</think>5"),
    ],
)
def test_reasoning_split_from_content_also_when_the_prompt_opens_it(family, prompt, text):
    """Qwen3 / DeepSeek-R1 reasoning, whether the model writes <think> or the template's
    generation prompt already opened it (R1)."""
    parsed = FAMILIES[family].parse(text, prompt=prompt)
    assert parsed.reasoning == "add them" and parsed.content == "5"


def test_reasoning_then_call():
    text = '<think>need a tool</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    parsed = FAMILIES["hermes"].parse(text, prompt="<|im_start|>assistant\n")
    assert parsed.reasoning == "need a tool" and parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"x": 1})]


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
        ("llama3", '{"name": "f", "parameters": {"x": '),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {]'),
        (
            "deepseek",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{x}\n```<｜tool▁call▁end｜>",
        ),
    ],
)
def test_ill_formed_calls_are_flagged_and_returned_as_text(family, text):
    parsed = FAMILIES[family].parse(text)
    assert parsed.ill_formed and parsed.tool_calls == () and parsed.content == text


def test_plain_text_and_disabled_tools_are_content():
    assert FAMILIES["llama3"].parse('The set {"a": 1}').content == 'The set {"a": 1}'
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parsed = FAMILIES["hermes"].parse(text, tools_enabled=False)
    assert parsed.tool_calls == () and parsed.content == text


def test_llama_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    calls = FAMILIES["llama3"].parse(text).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]


def test_family_detection_and_errors():
    assert detect_family("... <tool_call> ...") == "hermes"
    assert detect_family("{{ '<|start_header_id|>' }}") == "llama3"
    assert detect_family("[INST] [TOOL_CALLS]") == "mistral"
    assert detect_family("<｜Assistant｜><｜tool▁calls▁begin｜>") == "deepseek"
    assert detect_family("<tool_call><function=") == "qwen3_coder"
    assert detect_family("<tool_call>{{ name }}<arg_key>") == "glm"
    assert detect_family("<|im_assistant|><|tool_calls_section_begin|>") == "kimi_k2"
    assert response_format("auto", "{{ messages }}", native_tools=False).name == "hermes"
    with pytest.raises(ConfigError, match="agents.chat.family: unknown model family 'gpt5'"):
        response_format("gpt5")
    with pytest.raises(ConfigError, match="set agents.chat.family to one of"):
        response_format("auto", "{% for m in messages %}{{ tools }}{% endfor %}")


def test_chat_format_picks_the_family_and_refuses_a_mismatch():
    from rl_hf import build_tokenizer

    tok = build_tokenizer()  # ChatML template without tools: hermes
    assert ChatFormat(tok).format.name == "hermes"
    with pytest.raises(ConfigError, match="needs a chat template that renders tools"):
        ChatFormat(tok, ChatFormat.Config(family="llama3"))
    with pytest.raises(ConfigError, match="unknown model family"):
        ChatFormat(tok, ChatFormat.Config(family="nope"))


def test_hermes_and_qwen3_coder_templates_are_transformers_own():
    """The two templates copied from transformers stay equal to its current ones."""
    serving = pytest.importorskip("transformers.cli.serving.utils")
    fallbacks = serving._RESPONSE_TEMPLATE_FALLBACKS
    qwen3 = next(v for k, v in fallbacks.items() if "qwen3" in k)
    qwen35 = next(v for k, v in fallbacks.items() if "qwen3_5" in k)
    assert FAMILIES["hermes"].template == qwen3
    assert FAMILIES["qwen3_coder"].template == qwen35


def test_a_prompt_without_the_familys_anchor_is_not_read_as_the_message():
    """A template that renders the assistant header differently from the family's anchor: the
    prompt is not parsed as part of the message (only an open <think> is carried over)."""
    call = FAMILIES["llama3"].parse('{"name": "f", "parameters": {}}', prompt="user: hi\nbot:\n")
    assert [c.name for c in call.tool_calls] == ["f"] and call.content is None
    thought = FAMILIES["hermes"].parse("plan</think>ok", prompt="user: hi\n<think>\n")
    assert thought.reasoning == "plan" and thought.content == "ok"


def test_json_arguments_keep_the_models_types_text_arguments_are_cast():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
            },
        }
    ]
    hermes = FAMILIES["hermes"].parse(
        '<tool_call>{"name": "f", "arguments": {"n": "7"}}</tool_call>', tools=tools
    )
    assert json.loads(hermes.tool_calls[0].arguments) == {"n": "7"}
    glm = FAMILIES["glm"].parse(
        "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n</tool_call>", tools=tools
    )
    assert json.loads(glm.tool_calls[0].arguments) == {"n": 7}


def test_recipe_server_options_load_typed_and_a_wrong_family_fails_at_load():
    """generate_fn.server as a recipe gives it: chat.family and adapters load into the typed
    config; an unknown family is a ConfigError when the recipe is loaded, not at serving."""
    from rl_agents.server import AgentServer
    from rl_core.config import from_dict

    cfg = from_dict(
        AgentServer.Config,
        {"chat": {"family": "glm"}, "adapters": ["coder", "critic"]},
        path="generate_fn.server",
    )
    assert cfg.chat.family == "glm" and cfg.adapters == ("coder", "critic")
    with pytest.raises(ConfigError, match="unknown model family 'qwen9'"):
        from_dict(AgentServer.Config, {"chat": {"family": "qwen9"}}, path="generate_fn.server")
