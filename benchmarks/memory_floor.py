"""Peak RSS of full fine-tuning per configuration, beside the floor (weights + gradients + Adam).

Each configuration runs in its own process: it builds :class:`rl_hf.HFPolicy` (full fine-tuning,
AdamW) on the chosen model, resets the kernel's peak RSS (``/proc/self/clear_refs``), runs
``--steps`` train steps (optimizer step included) on a GRPO-shaped batch (``--groups`` prompts of
``--prompt-len`` tokens, ``--group-size`` samples of ``--response-len`` tokens each, micro-batches
of ``--micro-batch-seqs`` sequences), and reports:

- ``peak_mb``: the process's peak RSS during the steps (``VmHWM``);
- ``start_mb``: its RSS after the imports, before the model is built (interpreter, torch,
  transformers); ``built_mb``: after the policy is built and the allocator trimmed once (the
  weights may not all be resident yet: safetensors maps the file and pages come in on first use);
- ``peak_above_start_mb`` = ``peak_mb - start_mb``: the weights, the training state, a step's
  temporaries, and what the libraries allocate on first use (model code, kernels: ~130 MB on
  the tiny model), so the ratio below is an upper bound;
- ``after_step_mb``: RSS after the last step (what the process keeps between steps), and
  ``after_step_above_start_mb``;
- ``floor_mb``: weights + gradients + two Adam moments of the trainable parameters at the
  parameter dtype, the least full fine-tuning can hold, and ``ratio`` = ``peak_above_start_mb /
  floor_mb`` (issue #36's bar: full fine-tuning within 1.5x).

Configurations (``--configs``): ``default`` (the policy's defaults: the allocator trimmed after each
step), ``no_trim`` (``trim_host_memory: false``: glibc keeps a step's freed memory),
``no_trim_mmap`` (the same with ``MALLOC_MMAP_THRESHOLD_=131072``: large blocks are mmapped and
unmapped when freed), ``chunked`` (``logprob_chunk_tokens: 1024``, the smollm2_math recipe's
setting), ``chunked_ckpt`` (also ``activation_checkpointing``), ``chunked_ckpt_loop`` (also
``adamw_impl: for_loop``: AdamW's temporaries one tensor at a time instead of all at once),
``lean`` (the same with ``logprob_chunk_tokens: 128``: a chunk's ``[C, V]`` logits, their
log-softmax and their gradient are 25 MB each at SmolLM2's 49k vocabulary instead of 200 MB; a
micro-batch here has under 1024 scored positions, so 1024 is one chunk), ``lean_mmap`` (``lean``
with ``MALLOC_MMAP_THRESHOLD_=131072``), ``lean_policy_mmap`` (``lean`` with the policy's own
``host_mmap_threshold: 131072``, the same allocator setting from the config: the lowest-memory
setting), ``mmap_only`` (the defaults with ``host_mmap_threshold: 131072``).

Models (``--model``): ``tiny`` (rl_hf's test model: hidden 64, 2 layers, byte vocabulary),
``smollm2-shape`` (SmolLM2-135M's shape with ``--layers`` layers and random weights; the default,
4 layers), ``smollm2`` (the converted SmolLM2-135M-Instruct of ``make real-model``, in
``$RL_MODELS_HOME`` or ``~/.cache/rl-models``; 30 layers, minutes on a CPU).

Run: ``OMP_NUM_THREADS=1 python benchmarks/memory_floor.py [--model smollm2] [--configs a,b]``;
writes ``benchmarks/results/memory_floor_<model>.json`` (or ``--out``), keeping the rows of
configurations not run this time when the file was measured with the same model, batch, steps
and threads (each row has its own ``load_average`` and ``measured`` time), so configurations can
be measured one at a time on a busy machine. Not a test. Linux only (it reads
``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")
MB = 2**20

CONFIGS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "default": ({}, {}),
    "no_trim": ({"trim_host_memory": False}, {}),
    "no_trim_mmap": ({"trim_host_memory": False}, {"MALLOC_MMAP_THRESHOLD_": "131072"}),
    "chunked": ({"logprob_chunk_tokens": 1024}, {}),
    "chunked_ckpt": ({"logprob_chunk_tokens": 1024, "activation_checkpointing": True}, {}),
    "chunked_ckpt_loop": (
        {"logprob_chunk_tokens": 1024, "activation_checkpointing": True, "adamw_impl": "for_loop"},
        {},
    ),
    "lean": (
        {"logprob_chunk_tokens": 128, "activation_checkpointing": True, "adamw_impl": "for_loop"},
        {},
    ),
    "lean_mmap": (
        {"logprob_chunk_tokens": 128, "activation_checkpointing": True, "adamw_impl": "for_loop"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
    ),
    "lean_policy_mmap": (
        {
            "logprob_chunk_tokens": 128,
            "activation_checkpointing": True,
            "adamw_impl": "for_loop",
            "host_mmap_threshold": 131072,
        },
        {},
    ),
    "mmap_only": ({"host_mmap_threshold": 131072}, {}),
}
"""Name -> (HFPolicy.Config overrides, environment variables of the process)."""


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct of ``make real-model`` (``rl-train convert --smollm2``)."""
    home = Path(os.environ.get("RL_MODELS_HOME", Path.home() / ".cache" / "rl-models"))
    return home / "smollm2-135m-instruct"


def build_model(kind: str, directory: Path, layers: int) -> Path:
    """The model directory of ``--model``."""
    if kind == "smollm2":
        path = smollm2_dir()
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path}: no converted SmolLM2; run `make real-model` first.")
        return path
    if kind == "tiny":
        from rl_hf import build_tiny_model

        return build_tiny_model(directory)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _smollm2 import build_model as smollm2_shaped

    return smollm2_shaped(directory, layers, "float32")


def measure(model_dir: str, overrides: dict[str, Any], args: argparse.Namespace) -> dict:
    """One configuration in this process (see the module docstring)."""
    import torch

    from rl_core.batching import pack_sequences
    from rl_core.testing.policy import random_batch
    from rl_core.types import LossOutput
    from rl_hf import HFPolicy
    from rl_hf._allocator import trim_host_memory

    start_kb = _status_kb("VmRSS")
    policy = HFPolicy(HFPolicy.Config(model_path=model_dir, lr=1e-5, **overrides))
    vocab = policy.model_shape.vocab_size
    # GRPO-shaped: each group's samples share their prompt (prefix sharing applies).
    prompts = random_batch(vocab, [args.prompt_len] * args.groups, seed=0)
    responses = random_batch(vocab, [args.response_len] * args.groups * args.group_size, seed=1)
    seqs = []
    for g in range(args.groups):
        prompt = prompts.tokens[g * args.prompt_len : (g + 1) * args.prompt_len]
        for s in range(args.group_size):
            i = g * args.group_size + s
            resp = responses.tokens[i * args.response_len : (i + 1) * args.response_len]
            seqs.append(torch.cat([prompt, resp]))
    n = len(seqs)
    bounds = (*range(0, n, args.micro_batch_seqs), n)
    batch = pack_sequences(seqs, micro_batch_bounds=bounds)

    def loss_fn(logp_T: torch.Tensor, mb: Any, ent_T: Any) -> LossOutput:
        """Policy gradient: ``-sum(logp * advantage * weight)``."""
        return LossOutput(loss=-(logp_T * mb.advantages * mb.loss_weights).sum(), metrics={})

    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    grads = sum(p.numel() * p.element_size() for p in trainable)
    adam = 2 * grads
    trim_host_memory()  # what loading the model freed does not count as the training's
    built_kb = _status_kb("VmRSS")
    _reset_peak()
    seconds = []
    for _ in range(args.steps):
        t = time.perf_counter()
        policy.train_step(batch, loss_fn)
        seconds.append(round(time.perf_counter() - t, 2))
    peak_kb = _status_kb("VmHWM")
    after_kb = _status_kb("VmRSS")
    floor = weights + grads + adam
    return {
        "params": sum(p.numel() for p in policy.model.parameters()),
        "tokens_per_step": int(batch.num_tokens),
        "start_mb": round(start_kb / 1024),
        "built_mb": round(built_kb / 1024),
        "peak_mb": round(peak_kb / 1024),
        "after_step_mb": round(after_kb / 1024),
        "peak_above_start_mb": round((peak_kb - start_kb) / 1024),
        "after_step_above_start_mb": round((after_kb - start_kb) / 1024),
        "floor_mb": round(floor / MB),
        "floor_parts_mb": {
            "weights": round(weights / MB),
            "gradients": round(grads / MB),
            "adam": round(adam / MB),
        },
        "ratio": round((peak_kb - start_kb) * 1024 / floor, 2),
        "step_seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="smollm2-shape", choices=["tiny", "smollm2-shape", "smollm2"]
    )
    ap.add_argument("--layers", type=int, default=4, help="smollm2-shape: decoder layers")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--response-len", type=int, default=8)
    ap.add_argument("--micro-batch-seqs", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        model_dir, name = args.one.split(",")
        print(json.dumps(measure(model_dir, CONFIGS[name][0], args)))
        return
    names = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}.")
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.model, Path(tmp) / "model", args.layers)
        for name in names:
            overrides, env = CONFIGS[name]
            cmd = [sys.executable, __file__, "--one", f"{model_dir},{name}"]
            cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in _PASS]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, **env}, check=False
            )
            if proc.returncode != 0:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                rows[name] = {"error": proc.stderr[-300:]}
                continue
            rows[name] = {
                "policy": overrides,
                "env": env,
                **json.loads(proc.stdout.strip().splitlines()[-1]),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            r = rows[name]
            print(
                f"{name:>14}: peak {r['peak_mb']} MB ({r['peak_above_start_mb']} above start), "
                f"after step {r['after_step_mb']} MB ({r['after_step_above_start_mb']} above "
                f"start), floor {r['floor_mb']} MB, "
                f"ratio {r['ratio']}, steps {r['step_seconds']} s",
                flush=True,
            )
    result = {
        "what": "peak RSS of full fine-tuning train steps (HFPolicy, AdamW) per configuration, "
        "with the floor weights + gradients + Adam moments",
        "model": args.model,
        "layers": args.layers if args.model == "smollm2-shape" else None,
        "batch": {k: getattr(args, k) for k in sorted(_PASS - {"steps"})},
        "steps": args.steps,
        "host": platform.node(),
        "load_average": os.getloadavg(),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "configs": rows,
    }
    out = Path(args.out) if args.out else RESULTS / f"memory_floor_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file():  # keep the rows of configurations not run now, if measured alike
        old = json.loads(out.read_text())
        same = ("model", "layers", "batch", "steps", "threads")
        if all(old.get(k) == result[k] for k in same):
            result["configs"] = {
                **{k: v for k, v in old.get("configs", {}).items() if k not in rows},
                **rows,
            }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


_PASS = {"steps", "groups", "group_size", "prompt_len", "response_len", "micro_batch_seqs"}


if __name__ == "__main__":
    main()
