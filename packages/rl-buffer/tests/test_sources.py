"""File data sources: conformance, parsing errors, chat templates, slicing, length filter,
shuffling and the resumable cursor."""

from __future__ import annotations

import json
import logging

import pytest

from rl_buffer.sources import JsonlSource, MixtureSource, parse_sliced_path
from rl_core.errors import CheckpointError, ConfigError, DataError
from rl_core.testing.data_source import DataSourceConformance, FakeDataSource

RECORDS = [{"prompt": f"question {i}?", "label": str(i)} for i in range(7)]


class TestJsonlSource(DataSourceConformance):
    @pytest.fixture
    def data_source_factory(self, tmp_path, write_jsonl, char_tokenizer):
        path = write_jsonl(tmp_path / "math.jsonl", RECORDS)
        return lambda: JsonlSource(JsonlSource.Config(path=str(path), seed=5), char_tokenizer)


class TestJsonlSourceChatHF(DataSourceConformance):
    """Chat messages through the real (locally built) Hugging Face tokenizer, no shuffle."""

    @pytest.fixture
    def data_source_factory(self, tmp_path, write_jsonl, hf_tokenizer):
        recs = [
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": f"{i}+{i}="},
                ],
                "answer": 2 * i,
            }
            for i in range(5)
        ]
        path = write_jsonl(tmp_path / "chat.jsonl", recs)
        cfg = JsonlSource.Config(
            path=f"{path}@[1:]",
            input_key="messages",
            label_key="answer",
            apply_chat_template=True,
            shuffle=False,
        )
        return lambda: JsonlSource(cfg, hf_tokenizer)


class TestMixtureSource(DataSourceConformance):
    epoch_is_permutation = False

    @pytest.fixture
    def data_source_factory(self):
        def make():
            return MixtureSource(
                {
                    "a": (FakeDataSource(["a1", "a2", "a3"], seed=1), 2.0),
                    "b": (FakeDataSource(["b1", "b2"], seed=2), 1.0),
                },
                seed=7,
            )

        return make


def test_hf_chat_template_tokens_are_exact(tmp_path, write_jsonl, hf_tokenizer):
    msgs = [{"role": "user", "content": "2+2="}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": msgs, "label": "4"}])
    (p,) = JsonlSource(
        JsonlSource.Config(path=str(path), apply_chat_template=True), hf_tokenizer
    ).next_prompts(1)
    expected = hf_tokenizer.encode(
        "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert p.token_ids == tuple(expected)
    assert p.input == msgs and p.label == "4"


def test_text_prompt_with_template_becomes_user_message(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "label": 1}])
    cfg = JsonlSource.Config(
        path=str(path), apply_chat_template=True, chat_template_kwargs={"enable_thinking": False}
    )
    src = JsonlSource(cfg, char_tokenizer)
    assert char_tokenizer.template_calls == [{"enable_thinking": False}]
    (p,) = src.next_prompts(1)  # rendered again from the file when drawn
    assert p.token_ids == tuple(
        char_tokenizer.encode("<user>hi\n<nothink><assistant>", add_special_tokens=False)
    )
    assert char_tokenizer.template_calls == [{"enable_thinking": False}] * 2
    assert p.input == "hi"


def test_plain_text_adds_special_tokens_by_default(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ab", "label": 0}])
    (p,) = JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer).next_prompts(1)
    assert p.token_ids == (1000, 97, 98)
    cfg = JsonlSource.Config(path=str(path), add_special_tokens=False)
    (p,) = JsonlSource(cfg, char_tokenizer).next_prompts(1)
    assert p.token_ids == (97, 98)


def test_metadata_tools_and_uid(tmp_path, write_jsonl, char_tokenizer):
    recs = [
        {"q": "x", "a": 1, "meta": {"level": 3}, "tools": [{"name": "calc"}]},
        {"q": "y", "a": 2, "meta": json.dumps({"level": 5}), "tools": []},
    ]
    path = write_jsonl(tmp_path / "toolset.jsonl", recs)
    cfg = JsonlSource.Config(
        path=str(path),
        input_key="q",
        label_key="a",
        metadata_key="meta",
        tools_key="tools",
        apply_chat_template=True,
        shuffle=False,
    )
    src = JsonlSource(cfg, char_tokenizer)
    p0, p1, p2 = src.next_prompts(3)
    assert (p0.uid, p1.uid, p2.uid) == ("toolset:0:0", "toolset:0:1", "toolset:1:0")
    assert p0.metadata == {
        "level": 3,
        "tools": [{"name": "calc"}],
        "source": "toolset",
        "row": 0,
        "epoch": 0,
    }
    assert p1.metadata["level"] == 5
    assert char_tokenizer.template_calls[0] == {"tools": [{"name": "calc"}]}
    assert p0.label == 1
    # prompts do not share mutable state with the source
    p0.metadata["level"] = 99
    assert src.next_prompts(1)[0].metadata["level"] == 5  # epoch 1 row 1
    assert src.next_prompts(1)[0].metadata["level"] == 3  # epoch 2 row 0


def test_malformed_json_names_file_and_line(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            RECORDS[0],
            "",
            '{"prompt": "x", "label": ',
        ],
    )
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)


def test_missing_key_names_file_line_and_key(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(tmp_path / "k.jsonl", [RECORDS[0], {"question": "x", "label": 1}])
    with pytest.raises(DataError, match=r"k\.jsonl:2: missing key 'prompt'.*input_key"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "x"}])
    with pytest.raises(DataError, match=r"l\.jsonl:1: missing key 'label'.*label_key"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)
    # label_key=None: no label needed
    (p,) = JsonlSource(
        JsonlSource.Config(path=str(path), label_key=None), char_tokenizer
    ).next_prompts(1)
    assert p.label is None


def test_bad_input_types(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(
        tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "x"}], "label": 0}]
    )
    with pytest.raises(DataError, match=r"m\.jsonl:1: .*apply_chat_template"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": 5, "label": 0}])
    with pytest.raises(DataError, match=r"n\.jsonl:1: key 'prompt' must be a string"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)
    path = write_jsonl(tmp_path / "o.jsonl", [[1, 2]])
    with pytest.raises(DataError, match=r"o\.jsonl:1: expected a JSON object"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)


def test_missing_file_and_empty_file(tmp_path, write_jsonl, char_tokenizer):
    with pytest.raises(DataError, match="no such file"):
        JsonlSource(JsonlSource.Config(path=str(tmp_path / "nope.jsonl")), char_tokenizer)
    path = write_jsonl(tmp_path / "e.jsonl", [])
    with pytest.raises(DataError, match="no prompts left"):
        JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)


def test_slicing(tmp_path, write_jsonl, char_tokenizer):
    assert parse_sliced_path("a/b.jsonl@[2:5]") == ("a/b.jsonl", slice(2, 5))
    assert parse_sliced_path("a/b.jsonl@[:-1]") == ("a/b.jsonl", slice(None, -1))
    assert parse_sliced_path("a@b.jsonl") == ("a@b.jsonl", slice(None))
    path = write_jsonl(tmp_path / "s.jsonl", RECORDS)
    src = JsonlSource(JsonlSource.Config(path=f"{path}@[2:5]", shuffle=False), char_tokenizer)
    assert len(src) == 3
    assert [p.label for p in src.next_prompts(3)] == ["2", "3", "4"]
    src = JsonlSource(JsonlSource.Config(path=f"{path}@[-2:]", shuffle=False), char_tokenizer)
    assert [p.uid for p in src.next_prompts(2)] == ["s:0:5", "s:0:6"]
    # a malformed line outside the slice is never parsed
    bad = write_jsonl(tmp_path / "b.jsonl", [RECORDS[0], "not json"])
    assert len(JsonlSource(JsonlSource.Config(path=f"{bad}@[:1]"), char_tokenizer)) == 1


def test_over_long_prompts_dropped_counted_logged(tmp_path, write_jsonl, char_tokenizer, caplog):
    recs = [{"prompt": "x" * n, "label": n} for n in (3, 10, 4, 20, 5)]
    path = write_jsonl(tmp_path / "len.jsonl", recs)
    cfg = JsonlSource.Config(path=str(path), max_prompt_tokens=6, shuffle=False)
    with caplog.at_level(logging.WARNING):
        src = JsonlSource(cfg, char_tokenizer)
    assert len(src) == 3 and src.num_dropped_too_long == 2 and src.num_records == 5
    assert [p.label for p in src.next_prompts(3)] == [3, 4, 5]
    assert all(len(p.token_ids) <= 6 for p in src.next_prompts(3))  # never truncated: BOS+n
    assert src.stats()["data/len/dropped_too_long"] == 2.0
    assert "dropped 2 of 5" in caplog.text and "len.jsonl:2 (11 tokens)" in caplog.text


def test_shuffle_differs_per_epoch_and_seed(tmp_path, write_jsonl, char_tokenizer):
    recs = [{"prompt": f"p{i}", "label": i} for i in range(50)]
    path = write_jsonl(tmp_path / "sh.jsonl", recs)

    def order(seed, epochs=2):
        s = JsonlSource(JsonlSource.Config(path=str(path), seed=seed), char_tokenizer)
        return [[p.label for p in s.next_prompts(50)] for _ in range(epochs)]

    e0, e1 = order(0)
    assert sorted(e0) == sorted(e1) == list(range(50))
    assert e0 != e1 and e0 != list(range(50))
    assert order(1)[0] != e0
    assert order(0) == [e0, e1]


def test_load_state_refuses_changed_data(tmp_path, write_jsonl, char_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    src = JsonlSource(JsonlSource.Config(path=str(path)), char_tokenizer)
    src.next_prompts(3)
    state = src.state_dict()
    smaller = JsonlSource(JsonlSource.Config(path=f"{path}@[:5]"), char_tokenizer)
    with pytest.raises(CheckpointError, match="5"):
        smaller.load_state_dict(state)
    with pytest.raises(CheckpointError, match="out of range"):
        src.load_state_dict({**state, "position": 99})


def test_config_validation():
    with pytest.raises(ConfigError, match="max_prompt_tokens"):
        JsonlSource.Config(path="x.jsonl", max_prompt_tokens=0)
    with pytest.raises(ConfigError, match="path"):
        JsonlSource.Config(path="")


def test_mixture_weights_and_exact_resume():
    def make():
        return MixtureSource(
            {
                "a": (FakeDataSource([f"a{i}" for i in range(10)]), 3.0),
                "b": (FakeDataSource([f"b{i}" for i in range(10)]), 1.0),
            },
            seed=0,
        )

    mix = make()
    first = mix.next_prompts(2000)
    share_a = sum(p.metadata["mixture_source"] == "a" for p in first) / 2000
    assert 0.72 < share_a < 0.78
    assert mix.counts[0] + mix.counts[1] == 2000
    state = json.loads(json.dumps(mix.state_dict()))
    other = make()
    other.load_state_dict(state)
    assert other.next_prompts(1500) == mix.next_prompts(1500)  # crosses a 1024-draw block
    with pytest.raises(ConfigError, match="weights"):
        MixtureSource({"a": (FakeDataSource(["x"]), 0.0)})
