"""Data sources under bad input (issue #13): encodings, byte-order marks, unknown chat roles,
over-long prompts, and every malformed-record class ends in a DataError naming file:line."""

from __future__ import annotations

import codecs
import json
import logging

import pytest

from rl_buffer.sources import HFDatasetSource, JsonlSource
from rl_core.errors import ConfigError, DataError

GOOD = json.dumps({"prompt": "ok", "label": 1})


def _write_bytes(path, lines: list[bytes], newline: bytes = b"\n"):
    path.write_bytes(newline.join(lines) + newline)
    return path


def _chat(*roles: str, label: int = 0) -> dict:
    return {"prompt": [{"role": r, "content": f"{r} says hi"} for r in roles], "label": label}


# -- encodings -------------------------------------------------------------------------------


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_undecodable_bytes_name_file_line_column_and_fix(tmp_path, char_tokenizer, newline):
    bad = b'{"prompt": "caf\xe9", "label": 1}'  # latin-1 e-acute
    path = _write_bytes(tmp_path / "latin.jsonl", [GOOD.encode(), b"", bad], newline)
    with pytest.raises(
        DataError, match=r"latin\.jsonl:3: not valid UTF-8 \(byte 0xe9 at column 16\)"
    ):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)
    with pytest.raises(DataError, match="iconv"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)


def test_byte_order_mark_is_accepted(tmp_path, write_jsonl, char_tokenizer):
    recs = [{"prompt": f"q{i}", "label": i} for i in range(4)] + [_chat("system", "user")]
    plain = write_jsonl(tmp_path / "plain.jsonl", recs)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(codecs.BOM_UTF8 + plain.read_bytes())

    def draws(path):
        cfg = JsonlSource.Config(path=str(path), name="d", apply_chat_template=True)
        return JsonlSource(cfg, char_tokenizer).next_prompts(10)

    assert draws(bom) == draws(plain)
    # a mark in the middle of the file (concatenated files) is an error naming its line
    mid = tmp_path / "mid.jsonl"
    mid.write_bytes(plain.read_bytes() + codecs.BOM_UTF8 + GOOD.encode() + b"\n")
    with pytest.raises(DataError, match=r"mid\.jsonl:6: malformed JSON \(Unexpected UTF-8 BOM"):
        JsonlSource(JsonlSource.Config(path=str(mid), apply_chat_template=True), char_tokenizer)


# -- chat roles ------------------------------------------------------------------------------


def test_unknown_role_refused_by_default(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(tmp_path / "roles.jsonl", [_chat("user"), _chat("system", "narrator")])
    cfg = JsonlSource.Config(path=str(path), apply_chat_template=True)
    with pytest.raises(
        DataError,
        match=r"roles\.jsonl:2: message 1 has role 'narrator', not one of "
        r"data_source\.chat_roles=\['system', 'user', 'assistant', 'tool'\].*unknown_roles: skip",
    ):
        JsonlSource(cfg, char_tokenizer)
    # a non-string role is unknown too
    path = write_jsonl(tmp_path / "r2.jsonl", [{"prompt": [{"role": 3, "content": "x"}]}])
    with pytest.raises(DataError, match=r"r2\.jsonl:1: message 0 has role 3"):
        JsonlSource(JsonlSource.Config(path=str(path), label_key=None), char_tokenizer)


def test_unknown_role_skip_counts_and_logs(tmp_path, write_jsonl, char_tokenizer, caplog):
    recs = [_chat("user", label=0), _chat("narrator", label=1), _chat("system", "user", label=2)]
    recs += [_chat("user", "ipython", label=3)]
    path = write_jsonl(tmp_path / "skip.jsonl", recs)
    cfg = JsonlSource.Config(
        path=str(path), apply_chat_template=True, unknown_roles="skip", shuffle=False
    )
    with caplog.at_level(logging.WARNING):
        src = JsonlSource(cfg, char_tokenizer)
    # the template never saw the skipped records (the source renders a record again when drawn)
    assert len(char_tokenizer.template_calls) == 2
    assert [p.label for p in src.next_prompts(2)] == [0, 2]
    assert src.num_dropped_unknown_role == 2 and src.num_records == 4 and len(src) == 2
    assert src.stats()["data/skip/dropped_unknown_role"] == 2.0
    assert "skipped 2 of 4 records" in caplog.text and "data_source.chat_roles" in caplog.text
    assert "skip.jsonl:2 role 'narrator'" in caplog.text
    # a role the template renders can be allowed
    cfg = JsonlSource.Config(
        path=str(path), apply_chat_template=True, chat_roles=("user", "system", "ipython")
    )
    with pytest.raises(DataError, match=r"skip\.jsonl:2: message 0 has role 'narrator'"):
        JsonlSource(cfg, char_tokenizer)
    cfg.chat_roles = (*cfg.chat_roles, "narrator")
    assert len(JsonlSource(cfg, char_tokenizer)) == 4


def test_role_config_validation():
    with pytest.raises(ConfigError, match="unknown_roles"):
        JsonlSource.Config(path="x.jsonl", unknown_roles="drop")
    with pytest.raises(ConfigError, match="chat_roles"):
        JsonlSource.Config(path="x.jsonl", chat_roles=())


# -- prompt length ---------------------------------------------------------------------------


def test_limit_defaults_to_the_tokenizer_model_max_length(
    tmp_path, write_jsonl, char_tokenizer, caplog
):
    recs = [{"prompt": "x" * n, "label": n} for n in (3, 40, 4, 5000)]
    path = write_jsonl(tmp_path / "long.jsonl", recs)
    cfg = JsonlSource.Config(path=str(path), shuffle=False)
    # a tokenizer without a known limit (Hugging Face reports int(1e30)): nothing is dropped
    char_tokenizer.model_max_length = int(1e30)
    assert len(JsonlSource(cfg, char_tokenizer)) == 4
    char_tokenizer.model_max_length = 32
    with caplog.at_level(logging.WARNING):
        src = JsonlSource(cfg, char_tokenizer)
    assert src.max_prompt_tokens == 32 and src.num_dropped_too_long == 2
    assert [p.label for p in src.next_prompts(2)] == [3, 4]
    assert "model_max_length=32 (data_source.max_prompt_tokens is unset)" in caplog.text
    assert "long.jsonl:2 (41 tokens)" in caplog.text
    # max_prompt_tokens wins, with a warning when it exceeds what the model takes
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        src = JsonlSource(JsonlSource.Config(path=str(path), max_prompt_tokens=100), char_tokenizer)
    assert src.num_dropped_too_long == 1
    assert "max_prompt_tokens=100 exceeds the tokenizer's model_max_length=32" in caplog.text
    assert "longer than data_source.max_prompt_tokens=100" in caplog.text


def test_every_prompt_too_long_names_the_limit(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(tmp_path / "all.jsonl", [{"prompt": "x" * 50, "label": 0}])
    with pytest.raises(
        DataError,
        match=r"no prompts left.*1 longer than data_source\."
        r"max_prompt_tokens=8",
    ):
        JsonlSource(JsonlSource.Config(path=str(path), max_prompt_tokens=8), char_tokenizer)


# -- malformed records: every one names file:line --------------------------------------------

MALFORMED = {
    "truncated": ('{"prompt": "x", "label": ', r"malformed JSON \(Expecting value at column 26\)"),
    "not_json": ("prompt=x", r"malformed JSON"),
    "string_line": ('"just a string"', r"expected a JSON object .* got str"),
    "array_line": ("[1, 2]", r"expected a JSON object .* got list"),
    "null_line": ("null", r"expected a JSON object .* got NoneType"),
    "missing_prompt": ('{"question": "x", "label": 1}', r"missing key 'prompt'.*input_key"),
    "prompt_int": ('{"prompt": 5, "label": 1}', r"key 'prompt' must be a string"),
    "prompt_dict": ('{"prompt": {"a": 1}, "label": 1}', r"key 'prompt' must be a string"),
    "empty_messages": ('{"prompt": [], "label": 1}', r"got an empty list"),
    "message_no_role": ('{"prompt": [{"content": "x"}], "label": 1}', r"list of chat messages"),
    "message_not_dict": ('{"prompt": ["hi"], "label": 1}', r"list of chat messages"),
    "content_int": (
        '{"prompt": [{"role": "user", "content": 5}], "label": 1}',
        r"chat template failed",
    ),
    "meta_list": ('{"prompt": "x", "label": 1, "meta": [1]}', r"'meta' must be an object"),
    "meta_bad_string": (
        '{"prompt": "x", "label": 1, "meta": "{oops"}',
        r"key 'meta' is a string but not JSON",
    ),
    "huge_int": ('{"prompt": "x", "label": ' + "9" * 5000 + "}", r"malformed JSON \(.*digits"),
    "deep_nesting": ("[" * 100_000 + "]" * 100_000, r"malformed JSON \(.*recursion"),
    "empty_prompt": ('{"prompt": "", "label": 1}', r"zero tokens"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=MALFORMED.keys())
def test_malformed_record_is_a_data_error_naming_file_and_line(
    tmp_path, write_jsonl, char_tokenizer, case
):
    line, match = MALFORMED[case]
    good = {"prompt": "ok", "label": 1, "meta": {"level": 1}}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", line, good])
    cfg = JsonlSource.Config(
        path=str(path),
        metadata_key="meta" if "meta" in case else None,
        apply_chat_template=case in ("content_int",),
        add_special_tokens=False,
    )
    if case == "content_int":  # the real template concatenates content as text
        char_tokenizer.apply_chat_template = lambda m, **kw: "".join(x["content"] for x in m)
    with pytest.raises(DataError, match=r"bad\.jsonl:3: .*" + match):
        JsonlSource(cfg, char_tokenizer)


def test_tokenizer_failure_names_the_record(tmp_path, write_jsonl, hf_tokenizer):
    # a JSON escape can hold a lone surrogate, which a Rust tokenizer cannot encode
    path = write_jsonl(tmp_path / "sur.jsonl", [GOOD, '{"prompt": "a\\ud800b", "label": 1}'])
    with pytest.raises(DataError, match=r"sur\.jsonl:2: the tokenizer failed on this record"):
        JsonlSource(JsonlSource.Config(path=str(path)), hf_tokenizer)
    cfg = JsonlSource.Config(path=str(path), apply_chat_template=True)
    with pytest.raises(DataError, match=r"sur\.jsonl:2: the tokenizer failed on this record"):
        JsonlSource(cfg, hf_tokenizer)


# -- the datasets source reading a JSON-lines file -------------------------------------------


def test_hf_jsonl_errors_name_file_and_line(tmp_path, char_tokenizer):
    pytest.importorskip("datasets")
    path = _write_bytes(tmp_path / "h.jsonl", [GOOD.encode(), b'{"prompt": "\xff", "label": 2}'])
    with pytest.raises(DataError, match=r"h\.jsonl:2: not valid UTF-8"):
        HFDatasetSource(HFDatasetSource.Config(path=str(path)), char_tokenizer)
    path = _write_bytes(tmp_path / "m.jsonl", [GOOD.encode(), b'{"prompt": "x", "label": '])
    with pytest.raises(DataError, match=r"m\.jsonl:2: malformed JSON"):
        HFDatasetSource(HFDatasetSource.Config(path=str(path)), char_tokenizer)
    # a .json file is not read line by line: no line to blame, still a DataError naming it
    path = _write_bytes(tmp_path / "t.json", [b'[{"prompt": "x", "label": '])
    with pytest.raises(DataError, match=r"t\.json: datasets could not load it.*type: jsonl"):
        HFDatasetSource(HFDatasetSource.Config(path=str(path)), char_tokenizer)
    (tmp_path / "e.jsonl").write_bytes(b"\n")
    with pytest.raises(DataError, match=r"e\.jsonl: the file has no records"):
        HFDatasetSource(HFDatasetSource.Config(path=str(tmp_path / "e.jsonl")), char_tokenizer)
    bom = tmp_path / "b.jsonl"
    bom.write_bytes(codecs.BOM_UTF8 + GOOD.encode() + b"\n")
    (p,) = HFDatasetSource(HFDatasetSource.Config(path=str(bom)), char_tokenizer).next_prompts(1)
    assert p.input == "ok" and p.label == 1


def test_hf_bad_saved_directory(tmp_path, char_tokenizer):
    pytest.importorskip("datasets")
    d = tmp_path / "notsaved"
    d.mkdir()
    with pytest.raises(DataError, match=r"notsaved: not a dataset saved with save_to_disk"):
        HFDatasetSource(HFDatasetSource.Config(path=str(d)), char_tokenizer)
