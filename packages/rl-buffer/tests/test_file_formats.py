"""Parquet and Hugging Face `datasets` sources (optional extras): conformance and errors."""

from __future__ import annotations

import pytest

from rl_buffer.sources import HFDatasetSource, JsonlSource, ParquetSource
from rl_core.errors import DataError
from rl_core.testing.data_source import DataSourceConformance

RECORDS = [
    {"prompt": f"question {i}?", "label": str(i), "meta": {"difficulty": i % 3}} for i in range(6)
]


def _write_parquet(path, records):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


class TestParquetSource(DataSourceConformance):
    @pytest.fixture
    def data_source_factory(self, tmp_path, char_tokenizer):
        path = _write_parquet(tmp_path / "p.parquet", RECORDS)
        cfg = ParquetSource.Config(path=str(path), metadata_key="meta", seed=2)
        return lambda: ParquetSource(cfg, char_tokenizer)


class TestHFDatasetSourceSaved(DataSourceConformance):
    @pytest.fixture
    def data_source_factory(self, tmp_path, char_tokenizer):
        datasets = pytest.importorskip("datasets")
        d = tmp_path / "saved"
        datasets.Dataset.from_list(RECORDS).save_to_disk(str(d))
        cfg = HFDatasetSource.Config(path=f"{d}@[1:]", metadata_key="meta")
        return lambda: HFDatasetSource(cfg, char_tokenizer)


def test_same_prompts_from_every_format(tmp_path, write_jsonl, char_tokenizer):
    datasets = pytest.importorskip("datasets")
    j = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    p = _write_parquet(tmp_path / "d.parquet", RECORDS)
    saved = tmp_path / "d"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(saved))
    srcs = [
        JsonlSource(JsonlSource.Config(path=f"{j}@[1:5]", metadata_key="meta"), char_tokenizer),
        ParquetSource(ParquetSource.Config(path=f"{p}@[1:5]", metadata_key="meta"), char_tokenizer),
        HFDatasetSource(
            HFDatasetSource.Config(path=f"{saved}@[1:5]", metadata_key="meta"), char_tokenizer
        ),
        HFDatasetSource(
            HFDatasetSource.Config(path=f"{j}@[1:5]", name="d", metadata_key="meta"), char_tokenizer
        ),
    ]
    draws = [s.next_prompts(9) for s in srcs]
    assert all(d == draws[0] for d in draws[1:])
    assert draws[0][0].metadata["difficulty"] == int(draws[0][0].label) % 3


def test_parquet_missing_column_names_row_and_key(tmp_path, char_tokenizer):
    p = _write_parquet(tmp_path / "m.parquet", [{"question": "x", "label": "1"}])
    with pytest.raises(DataError, match=r"m\.parquet:row 0: missing key 'prompt'"):
        ParquetSource(ParquetSource.Config(path=str(p)), char_tokenizer)


def test_parquet_corrupt_file(tmp_path, char_tokenizer):
    pytest.importorskip("pyarrow")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        ParquetSource(ParquetSource.Config(path=str(bad)), char_tokenizer)
