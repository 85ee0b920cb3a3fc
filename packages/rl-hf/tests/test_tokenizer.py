"""The locally built byte-level ChatML tokenizer (rl_hf.tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hypothesis import given, settings
from hypothesis import strategies as st

from rl_hf.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer

TOK = build_tokenizer()


def test_ids_are_bytes_then_specials() -> None:
    """Byte b has id b; the four special tokens follow at 256..259; eos and pad are set."""
    assert len(TOK) == VOCAB_SIZE == 260
    assert TOK.encode("A\n\x00", add_special_tokens=False) == [65, 10, 0]
    assert TOK.encode("é", add_special_tokens=False) == list("é".encode())
    assert [TOK.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [256, 257, 258, 259]
    assert (TOK.eos_token, TOK.eos_token_id) == ("<|im_end|>", 258)
    assert (TOK.pad_token, TOK.pad_token_id) == ("<|pad|>", 259)
    assert TOK.bos_token_id is None


def test_deterministic_across_builds(tmp_path: Path) -> None:
    """Two builds give byte-identical tokenizer.json files."""
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


@pytest.mark.parametrize(
    "text", ["", "hello world", "  two  spaces\tand tab\n", "héllo wörld 12+7=", "日本語 🙂 ∑"]
)
def test_roundtrip_examples(text: str) -> None:
    """decode(encode(x)) == x and one id per UTF-8 byte."""
    ids = TOK.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_roundtrip_any_text(text: str) -> None:
    """Any unicode text (no special-token strings) round-trips exactly."""
    ids = TOK.encode(text, add_special_tokens=False)
    assert TOK.decode(ids) == text


def test_special_tokens_are_atomic() -> None:
    """Special-token strings encode to one id and can be skipped when decoding."""
    ids = TOK.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert ids == [257, 104, 105, 258]
    assert TOK.decode(ids, skip_special_tokens=True) == "hi"


def test_chat_template() -> None:
    """ChatML rendering, with and without the generation prompt."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2="},
    ]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n"
    assert TOK.apply_chat_template(messages, tokenize=False) == body
    text = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == body + "<|im_start|>assistant\n"
    ids = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == TOK.encode(text, add_special_tokens=False)


def test_save_and_reload(tmp_path: Path) -> None:
    """save_dir writes files AutoTokenizer loads back with the same ids, template and specials."""
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    sample = "<|im_start|>user\nçà 🙂<|im_end|>"
    assert loaded.encode(sample, add_special_tokens=False) == TOK.encode(
        sample, add_special_tokens=False
    )
    assert (loaded.eos_token_id, loaded.pad_token_id) == (258, 259)
    assert loaded.chat_template == TOK.chat_template
    assert loaded.padding_side == "left"
