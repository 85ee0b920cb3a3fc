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
