"""JsonlSource tokenizes its file in batches through a fast tokenizer's backend (issue #36), with
exactly the ids of one ``tokenizer.encode`` per record: on varied text (unicode, emoji, long rows,
special-token strings, whitespace), with and without the chat template, with BOS added by a post
processor; a tokenizer that cannot be shown the same is encoded one record at a time."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from rl_buffer import JsonlSource
from rl_buffer import sources as sources_mod
from rl_core.errors import DataError

TEXTS = [
    "What is 12 + 30?",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n inside",
    "Ünïcödé: naïve café, Straße, ΑΒΓ, кириллица",
    "中文字符和日本語のテキスト、한국어",
    "emoji 👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, combining e\u0301 a\u0308",
    "special strings <|im_start|>user\nhi<|im_end|> inside the text",
    "numbers 3.14159 1e-10 -42 0x1F 1,000,000",
    "x" * 5000,
    " ".join(f"word{i}" for i in range(800)),
    "RTL עברית العربية mixed",
    "\u200b zero width \ufeff and NBSP\u00a0here",
    "a",
]


def _bpe_tokenizer():
    """A byte-level BPE with merges (trained here, no download), BOS added by a post processor,
    ChatML special tokens and template: unlike the byte tokenizer, merges depend on context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from rl_hf.tokenizer import CHATML_TEMPLATE

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(
        TEXTS * 3 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer
    )
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _write(path: Path, n: int = 1100) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = TEXTS[i % len(TEXTS)]
            if i % 3 == 0:
                text = f"{i}: {text}"
            if i % 5 == 1:
                prompt = [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": text},
                ]
            else:
                prompt = text
            f.write(json.dumps({"prompt": prompt, "label": i}, ensure_ascii=i % 2 == 0) + "\n")
    return path


@pytest.fixture(params=["byte", "bpe"])
def fast_tokenizer(request, hf_tokenizer):
    return hf_tokenizer if request.param == "byte" else _bpe_tokenizer()


@pytest.mark.parametrize("chat", [False, True])
def test_batched_ids_equal_per_record_encode(tmp_path, fast_tokenizer, chat, monkeypatch):
    """Every record's ids (and so the length filter, len() and every draw) equal a source that
    encodes one record at a time; ids equal ``tokenizer.encode`` of the rendered text."""
    path = _write(tmp_path / "d.jsonl")
    if not chat:  # chat messages need the template: keep the text records only
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if '"role"' not in ln]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = JsonlSource.Config(path=str(path), apply_chat_template=chat, max_prompt_tokens=300)

    calls = []
    real = sources_mod._batch_encoder

    def spy(tok):
        enc = real(tok)
        assert enc is not None, "a transformers fast tokenizer must get the batch encoder"

        def counted(texts, add):
            calls.append(len(texts))
            return enc(texts, add)

        return counted

    monkeypatch.setattr(sources_mod, "_batch_encoder", spy)
    monkeypatch.setattr(sources_mod, "_ENCODE_BATCH", 256)  # several batches and a partial one
    monkeypatch.setattr(sources_mod, "_length_bound", lambda tok: None)  # encode every row
    batched = JsonlSource(cfg, fast_tokenizer)
    assert sum(calls) == batched.num_records - batched.num_dropped_unknown_role
    assert max(calls) == 256 and len(calls) > 2

    monkeypatch.setattr(sources_mod, "_batch_encoder", lambda tok: None)
    per_row = JsonlSource(cfg, fast_tokenizer)

    assert batched.num_dropped_too_long > 0  # the long rows: the filter saw the batch's lengths
    assert (len(batched), batched.num_dropped_too_long) == (
        len(per_row),
        per_row.num_dropped_too_long,
    )
    assert batched._row_ids == per_row._row_ids
    drawn = batched.next_prompts(len(batched))
    assert drawn == per_row.next_prompts(len(per_row))
    recs = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines()]
    ids_by_row = {p.metadata["row"]: p.token_ids for p in drawn}
    # the kept rows' ids straight from the batch encoder equal encode() one at a time
    texts = []
    for row in sorted(ids_by_row):
        inp = recs[row]["prompt"]
        if chat:
            msgs = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
            texts.append(
                fast_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            )
        else:
            texts.append(inp)
    add = not chat
    batch_ids = [e.ids for e in real(fast_tokenizer)(texts, add)]
    assert batch_ids == [fast_tokenizer.encode(t, add_special_tokens=add) for t in texts]
    assert [tuple(x) for x in batch_ids] == [ids_by_row[r] for r in sorted(ids_by_row)]


def test_tokenizer_without_a_provable_batch_is_encoded_per_record(hf_tokenizer, char_tokenizer):
    """A plain tokenizer, or a fast one whose ``encode`` is overridden, or one with truncation
    set on its backend, gets no batch encoder."""
    assert sources_mod._batch_encoder(char_tokenizer) is None

    class Custom(type(hf_tokenizer)):
        def encode(self, text, add_special_tokens=True, **kw):
            return super().encode(text.lower(), add_special_tokens=add_special_tokens, **kw)

    custom = Custom(tokenizer_object=hf_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    assert sources_mod._batch_encoder(custom) is None
    truncating = _bpe_tokenizer()
    truncating.backend_tokenizer.enable_truncation(8)
    assert sources_mod._batch_encoder(truncating) is None
    assert sources_mod._batch_encoder(hf_tokenizer) is not None


def test_a_batch_that_differs_falls_back_to_per_record(tmp_path, hf_tokenizer, monkeypatch, caplog):
    """The first batch is checked against encode(); a difference is logged and every record is
    then encoded one at a time (the ids stay encode()'s)."""
    path = _write(tmp_path / "d.jsonl", 200)
    cfg = JsonlSource.Config(path=str(path), apply_chat_template=True)
    monkeypatch.setattr(
        sources_mod, "_batch_encoder", lambda tok: lambda texts, add: [[7] for _ in texts]
    )
    monkeypatch.setattr(sources_mod, "_length_bound", lambda tok: None)  # encode every row
    with caplog.at_level(logging.WARNING, logger="rl_buffer.sources"):
        src = JsonlSource(cfg, hf_tokenizer)
    assert "batch encoding differs" in caplog.text
    assert src._batch_encode is None
    monkeypatch.setattr(sources_mod, "_batch_encoder", lambda tok: None)
    assert src.next_prompts(200) == JsonlSource(cfg, hf_tokenizer).next_prompts(200)


def test_errors_in_a_batch_name_the_first_bad_record(tmp_path, hf_tokenizer):
    """A record the tokenizer refuses (a lone surrogate) is named by its line even inside a batch,
    and before a later malformed line of the same batch."""
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "label": i}) for i in range(10)]
    lines[3] = '{"prompt": "bad \\ud800 surrogate", "label": 3}'
    lines[6] = '{"prompt": "unterminated'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:4: the tokenizer failed"):
        JsonlSource(JsonlSource.Config(path=str(path)), hf_tokenizer)
    lines[6] = json.dumps({"prompt": "fine", "label": 6})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:4: the tokenizer failed"):
        JsonlSource(JsonlSource.Config(path=str(path)), hf_tokenizer)


# -- prompts proven short enough are not tokenized while indexing ------------------------------

BOUND_TEXTS = [*TEXTS, "", " ", "<|im_start|>", "<s>", "<s><s> <|im_end|>", "bad \ud800", "é" * 7]


def _nfc_tokenizer():
    """The BPE tokenizer with a Unicode normalizer (NFC), as Qwen2's."""
    from tokenizers import normalizers

    tok = _bpe_tokenizer()
    tok.backend_tokenizer.normalizer = normalizers.NFC()
    return tok


@pytest.mark.parametrize("kind", ["byte", "bpe", "nfc"])
def test_length_bound_is_an_upper_bound(hf_tokenizer, kind):
    """Where the bound is known, encode() gives between 1 and that many tokens, with and without
    special tokens (the BPE one adds a BOS); it is unknown only for empty text, a lone surrogate
    and, under a normalizer, non-ASCII text; the byte tokenizer meets it exactly on ASCII."""
    tok = {"byte": lambda: hf_tokenizer, "bpe": _bpe_tokenizer, "nfc": _nfc_tokenizer}[kind]()
    bound = sources_mod._length_bound(tok)
    assert bound is not None
    assert bound.specials == (1 if kind != "byte" else 0)
    for add in (True, False):
        for text in BOUND_TEXTS:
            n = bound.max_tokens(text, add)
            unknown = text == "" or "\ud800" in text or (kind == "nfc" and not text.isascii())
            assert (n is None) == unknown, (kind, text)
            if n is not None:
                got = len(tok.encode(text, add_special_tokens=add))
                assert 1 <= got <= n, (kind, text, add, got, n)
                if kind == "byte" and "<|" not in text:
                    assert got == n


def test_length_bound_needs_a_known_structure(hf_tokenizer, char_tokenizer):
    """No bound for a plain tokenizer, a non-Unicode normalizer, a prefix space added by the
    pre-tokenizer, a model other than BPE, or a vocabulary missing byte symbols."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert sources_mod._length_bound(char_tokenizer) is None
    lower = _bpe_tokenizer()
    lower.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert sources_mod._length_bound(lower) is None
    prefix = _bpe_tokenizer()
    prefix.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert sources_mod._length_bound(prefix) is None
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    for model in (
        models.WordLevel({s: i for i, s in enumerate(alphabet)}, unk_token=alphabet[0]),
        models.BPE({"é": 0}, []),  # no ASCII byte is a token
    ):
        core = Tokenizer(model)
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        assert sources_mod._length_bound(PreTrainedTokenizerFast(tokenizer_object=core)) is None
    assert sources_mod._length_bound(hf_tokenizer) is not None


def test_bytes_missing_from_the_vocabulary_are_dropped_within_the_bound():
    """A BPE vocabulary without some byte symbols (as SmolLM2's: a few control bytes) drops
    them: still within the bound; a text of only such bytes may give zero tokens, so it gets no
    bound (encode() decides, and a zero-token prompt stays an error)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    drop = {pre.pre_tokenize_str(c)[0][0] for c in "\x04ab"}
    core = Tokenizer(models.BPE({s: i for i, s in enumerate(sorted(set(alphabet) - drop))}, []))
    core.pre_tokenizer = pre
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    bound = sources_mod._length_bound(tok)
    assert bound is not None
    for text in ("\x04", "ab\x04ba", "é"):  # only dropped ASCII bytes, or no ASCII at all
        assert bound.max_tokens(text, True) is None
    assert tok.encode("ab\x04") == []
    for text in ("abc", "\x04c\x04", "xé", "a b"):
        assert 1 <= len(tok.encode(text)) <= bound.max_tokens(text, True), text


@pytest.mark.parametrize("kind", ["byte", "bpe", "nfc"])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("limit", [100, None])
def test_bounded_prompts_skip_encoding_with_the_same_draws(
    tmp_path, hf_tokenizer, monkeypatch, kind, chat, limit
):
    """A source that encodes only the prompts whose bound exceeds the limit keeps exactly the
    prompts (counts, rows, draws) of one that encodes every prompt; at 100 tokens some prompts are
    over the bound but within the limit (kept after encoding) and some over it (dropped)."""
    tok = {"byte": lambda: hf_tokenizer, "bpe": _bpe_tokenizer, "nfc": _nfc_tokenizer}[kind]()
    path = _write(tmp_path / "d.jsonl", 150)
    cfg = JsonlSource.Config(path=str(path), apply_chat_template=chat, max_prompt_tokens=limit)
    encoded: list[str] = []
    real = JsonlSource._encode_many

    def spy(self, texts, wheres):
        encoded.extend(texts)
        return real(self, texts, wheres)

    monkeypatch.setattr(JsonlSource, "_encode_many", spy)
    if not chat:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if '"role"' not in ln]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    fast = JsonlSource(cfg, tok)
    n_encoded = len(encoded)
    monkeypatch.setattr(sources_mod, "_length_bound", lambda t: None)
    encoded.clear()
    every = JsonlSource(cfg, tok)
    assert len(encoded) == every.num_records  # the reference encodes every prompt
    assert n_encoded < every.num_records and (n_encoded > 0 or limit is None)
    if limit == 100:
        assert every.num_dropped_too_long > 0
        if kind == "bpe":  # merges: some prompts over the bound are within the limit
            assert n_encoded > every.num_dropped_too_long
    assert fast.stats() == every.stats()
    assert fast._row_ids == every._row_ids
    assert fast.next_prompts(2 * len(fast)) == every.next_prompts(2 * len(every))


# -- JSON lines parsed by orjson where installed: the values of json.loads ---------------------

JSON_LINES = [
    '{"a": 1, "a": 2}',
    '{"x": NaN, "y": Infinity, "z": -Infinity}',
    '{"big": 1e400, "neg": -1e400, "tiny": 1e-400}',
    '{"z": -0, "f": -0.0, "e": 1E5, "g": 0.1000000000000000055511151231257827}',
    '{"u64": 18446744073709551616, "i64": -9223372036854775809, "ok": 9223372036854775807}',
    "[18446744073709551615, 9223372036854775808, -9223372036854775808, 123456789012345678]",
    "[1234567890123456789.5, 1.5e308, 1e309, 4.9e-324, 2.2250738585072014e-308]",
    '{"id": "12345678901234567890"}',
    '{"s": "\\ud800 lone"}',
    '{"s": "\\ud83d\\ude00 pair", "t": "\\u00e9\\n\\t\\"\\\\\\/"}',
    '{"s": "\\u0000 nul", "del": "\x7f"}',
    ' \t{"sp" : [1, 2.5e-3 ,true,false,null] } \t',
    '{"a": 1} x',
    "\ufeff{}",
    '{"tab": "raw\ttab"}',
    "0123",
    "1.",
    ".5",
    "[1,]",
    "{'a': 1}",
    '"\\x41"',
    '{"deep": ' + "[" * 2000 + "]" * 2000 + "}",
    '{"ok": ' + "[" * 500 + "]" * 500 + "}",
    '{"ünï": "çödé 中文 👩‍👩‍👧"}',
    "[]",
    "17",
]


def test_orjson_lines_parse_as_json_loads(monkeypatch):
    """Every line gives the same value (type and repr: -0.0, inf, big integers, the last of a
    duplicate key) or the same DataError through orjson as through json.loads alone."""
    pytest.importorskip("orjson")
    assert sources_mod._orjson_loads is not None

    def parse(line):
        try:
            return (
                "ok",
                repr(sources_mod._parse_json_bytes(line.encode("utf-8", "surrogatepass"), "f:1")),
            )
        except DataError as e:
            return ("error", str(e))

    with_orjson = [parse(line) for line in JSON_LINES]
    monkeypatch.setattr(sources_mod, "_orjson_loads", None)
    assert with_orjson == [parse(line) for line in JSON_LINES]
    assert sum(kind == "ok" for kind, _ in with_orjson) >= 10
