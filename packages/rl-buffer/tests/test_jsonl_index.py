"""JsonlSource keeps an index of the file, not its prompts (issue #36): its draws are the same
prompts in the same order as an in-memory source of the same records (shuffle, epochs, slices,
filters, resume), its memory does not grow with the prompts, and a file that changes under it is
an error."""

from __future__ import annotations

import codecs
import io
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from rl_buffer import JsonlSource
from rl_buffer import sources as sources_mod
from rl_buffer.sources import FileSource
from rl_core.errors import DataError


class InMemoryJsonl(FileSource):
    """The reference: every record read into memory at once (the way JsonlSource read files
    before it kept an index), through FileSource's in-memory rows."""

    def _read_records(self):
        text = self.file.read_bytes().decode("utf-8-sig")
        lines = [
            (n, line)
            for n, line in enumerate(io.StringIO(text, newline=None), start=1)
            if line.strip()
        ]
        return [
            (row, f"{self.file}:{n}", json.loads(line), None)
            for row, (n, line) in list(enumerate(lines))[self._slice]
        ]


def _records() -> list[Any]:
    recs: list[Any] = []
    for i in range(40):
        if i % 7 == 3:  # too long for max_prompt_tokens=24
            recs.append({"prompt": "x" * (20 + i), "label": i})
        elif i % 9 == 5:  # a role outside chat_roles: skipped
            recs.append({"prompt": [{"role": "narrator", "content": f"n{i}"}], "label": i})
        elif i % 2:
            recs.append({"prompt": [{"role": "user", "content": f"c{i}"}], "label": i})
        else:
            recs.append({"prompt": f"q{i}", "label": i, "meta": {"k": i}})
    return recs


def _write(path: Path, recs: list[Any]) -> Path:
    """A BOM, CRLF and lone-CR line ends, blank lines: what the line reader must get right."""
    parts = []
    for i, r in enumerate(recs):
        parts.append(json.dumps(r) + ("\r\n", "\r", "\n")[i % 3])
        if i % 5 == 0:
            parts.append("  \n")
    path.write_bytes(codecs.BOM_UTF8 + "".join(parts).encode())
    return path


def _config(path: Path, **kw: Any) -> JsonlSource.Config:
    base = dict(
        path=str(path),
        name="d",
        apply_chat_template=True,
        max_prompt_tokens=24,
        unknown_roles="skip",
        metadata_key=None,
        seed=5,
    )
    return JsonlSource.Config(**{**base, **kw})


@pytest.mark.parametrize("slice_", ["", "@[3:31]", "@[-17:]"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_draws_equal_the_in_memory_source(tmp_path, char_tokenizer, slice_, shuffle):
    """Same prompts (uid, tokens, input, label, metadata) in the same order over 2.5 epochs,
    and the same continuation after a resume mid-epoch."""
    path = _write(tmp_path / "d.jsonl", _records())
    cfg = _config(Path(str(path) + slice_), shuffle=shuffle)
    indexed = JsonlSource(cfg, char_tokenizer)
    reference = InMemoryJsonl(cfg, char_tokenizer)
    assert len(indexed) == len(reference) > 5
    assert indexed.stats() == reference.stats()
    assert indexed._rows == []  # only the index is kept
    n = len(indexed)
    assert indexed.next_prompts(n // 2) == reference.next_prompts(n // 2)
    state = indexed.state_dict()
    assert state == reference.state_dict()
    assert indexed.next_prompts(2 * n) == reference.next_prompts(2 * n)
    resumed = JsonlSource(cfg, char_tokenizer)
    resumed.load_state_dict(state)
    indexed.load_state_dict(state)
    assert resumed.next_prompts(n) == indexed.next_prompts(n)


def test_memory_does_not_hold_the_prompts(tmp_path, char_tokenizer, monkeypatch):
    """10,000 records: the in-memory source holds megabytes of prompts; the index 28 bytes a
    prompt, read through 4 kB chunks here."""
    monkeypatch.setattr(sources_mod, "_CHUNK", 4096)
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(10_000):
            f.write(json.dumps({"prompt": f"{i % 997}+{i % 89}=", "label": i}) + "\n")
    cfg = JsonlSource.Config(path=str(path), name="d")
    peaks = {}
    for kind in (JsonlSource, InMemoryJsonl):
        tracemalloc.start()
        src = kind(cfg, char_tokenizer)
        peaks[kind.__name__] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        assert len(src) == 10_000
        del src
    assert peaks["JsonlSource"] < 1.5, peaks
    assert peaks["InMemoryJsonl"] > 5 * peaks["JsonlSource"], peaks


def test_lines_across_chunk_boundaries(tmp_path, char_tokenizer, monkeypatch):
    """Chunks far smaller than a line, a CRLF split between two chunks: the same records."""
    path = _write(tmp_path / "d.jsonl", _records())
    cfg = _config(path, shuffle=False)
    want = InMemoryJsonl(cfg, char_tokenizer).next_prompts(60)
    for chunk in (1, 2, 7, 64):
        monkeypatch.setattr(sources_mod, "_CHUNK", chunk)
        assert JsonlSource(cfg, char_tokenizer).next_prompts(60) == want, chunk


def test_a_file_changed_after_indexing_is_an_error(tmp_path, char_tokenizer):
    path = _write(tmp_path / "d.jsonl", _records())
    src = JsonlSource(_config(path), char_tokenizer)
    src.next_prompts(3)
    with open(path, "ab") as f:
        f.write(b'{"prompt": "new", "label": 0}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: changed \(or removed\) since the source"):
        src.next_prompts(1)
    os.remove(path)
    with pytest.raises(DataError, match="start the run again"):
        src.next_prompts(1)


def test_blank_lines_as_str_strip_counts_them(tmp_path, char_tokenizer):
    """Lines of Unicode whitespace only (ideographic space, NBSP, separators \\x1c-\\x1f) are
    blank, as the in-memory reader counts them; a record after them keeps its line number."""
    recs = _records()[:6]
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in recs]
    lines[1:1] = ["\u3000\u2003", "\x1c\x1f ", "\u00a0", "\t\x0b\x0c"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = _config(path, shuffle=False)
    src = JsonlSource(cfg, char_tokenizer)
    assert len(src) == len(InMemoryJsonl(cfg, char_tokenizer)) == 4  # too long, unknown role
    assert src.next_prompts(9) == InMemoryJsonl(cfg, char_tokenizer).next_prompts(9)
    assert list(src._linenos) == [1, 6, 7, 9]


def test_draws_equal_without_orjson(tmp_path, char_tokenizer, monkeypatch):
    """orjson (optional) only parses faster: without it the same prompts and counts."""
    path = _write(tmp_path / "d.jsonl", _records())
    cfg = _config(path)
    with_orjson = JsonlSource(cfg, char_tokenizer)
    monkeypatch.setattr(sources_mod, "_orjson_loads", None)
    without = JsonlSource(cfg, char_tokenizer)
    assert with_orjson.stats() == without.stats()
    assert with_orjson.next_prompts(90) == without.next_prompts(90)
