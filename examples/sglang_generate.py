"""rl-sglang: rollouts from a real SGLang server (launched and owned by the generator), then a
weight update from a ``disk_full`` version, as a trainer would publish it.

SGLang lives in its own virtual environment (it pins its own torch):
``packages/rl-sglang/scripts/setup_sglang_env.sh`` makes it; ``SGLangGenerator.Config.python``
points at it (default: that venv). On a CPU a server takes about a minute to start.

    OMP_NUM_THREADS=1 python examples/sglang_generate.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from rl_core.types import GenerationRequest, SamplingParams
from rl_hf import build_tiny_model
from rl_sglang import SGLangGenerator
from rl_weightsync import DiskFullTransport


async def main(root: Path) -> None:
    """Generate greedily, publish changed weights, generate again on version 1."""
    path = build_tiny_model(root / "tiny")
    gen = SGLangGenerator(SGLangGenerator.Config(model_path=str(path), device="cpu"))
    try:
        request = GenerationRequest(
            request_id="q0",
            input_ids=(72, 101, 108, 108, 111),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=6),
        )
        (before,) = await gen.generate([request])
        print(f"v{before.weight_version}: {before.output_ids} log-probs {before.output_logprobs}")

        weights = load_file(str(path / "model.safetensors"))
        weights["model.norm.weight"] = -weights["model.norm.weight"]  # a visible change
        transport = DiskFullTransport(
            DiskFullTransport.Config(directory=root / "sync", assets_dir=str(path))
        )
        update = transport.publish(1, weights.items())
        await gen.update_weights(update, transport)  # the server loads the verified directory
        (after,) = await gen.generate([request])
        print(f"v{after.weight_version}: {after.output_ids} log-probs {after.output_logprobs}")
        assert after.weight_version == 1
    finally:
        await gen.close()  # stops the server it launched


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
