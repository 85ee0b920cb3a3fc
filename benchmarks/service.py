"""rl-tinker service benchmark: tenants sharing one base, per-operation overhead, cookbook runs.

Parts (``--part``, default all):

- ``tenants``: N LoRA tenants (``--tenants``, default 4) each run K steps (``--steps``) of
  ``forward_backward`` (cross_entropy, ``--batch`` datums of ``--seq`` tokens) + ``optim_step``
  through the official tinker SDK, all submitted concurrently to ONE service (one base model in
  memory), against the same N runs made one after another, each on its own fresh service (N
  bases in memory if run side by side). Reports wall seconds, trained tokens/s, the service's
  queue and compute seconds per operation, and memory: parameter + optimizer bytes of one base
  + N adapters (+ their Adam moments) against N x (base + adapter), and the process's peak RSS.
- ``overhead``: median seconds of one ``forward_backward`` + ``optim_step`` (one datum) through
  the SDK and the service, against the same backend calls in process (no HTTP, no futures).
- ``cookbook``: tinker-cookbook's supervised.train (its example conversations, 2 epochs) and
  rl.train on our LettersTask (``--rl-steps``), unmodified against the service; writes their
  curves (NLL per step, mean reward per step). Needs tinker-cookbook importable.
- ``sampler``: in process, ``BaseModel.sample`` of one trained snapshot (``--samples``
  continuations of ``--sample-tokens`` tokens, temperature 1, stop ids only) with each
  ``sampler`` (``policy``: the service's own loop; ``hf``: rl-hf's HFGenerator): median seconds,
  and the bytes of the generator's tensors that are NOT the base model's (0: shared weights).

Model: ``--model tiny`` (built here) or ``--model smollm2`` (the converted SmolLM2-135M-Instruct
under ``~/.cache/rl-models``, ``rl-train convert --smollm2``). Writes
``benchmarks/results/service.json`` (``--out``). Not a test: a few minutes on 2 CPU cores with
the tiny model. Run: ``OMP_NUM_THREADS=1 python benchmarks/service.py [--part tenants]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _results import write_results


def _model_dir(name: str, work: Path) -> Path:
    if name == "tiny":
        from rl_hf.tiny import build_tiny_model

        return build_tiny_model(work / "tiny")
    path = Path("~/.cache/rl-models/smollm2-135m-instruct").expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path}: run `rl-train convert --smollm2` first")
    return path


def _service(model: Path, state: Path, batch_tenants: bool = False) -> Any:
    from rl_tinker.config import ServiceConfig
    from rl_tinker.runner import start

    return start(
        ServiceConfig(
            models={"base": str(model)}, state_dir=str(state), port=0, batch_tenants=batch_tenants
        )
    )


def _data(tok: Any, batch: int, seq: int) -> list[Any]:
    import tinker

    text = "the quick brown fox jumps over the lazy dog " * 64
    ids = list(tok.encode(text))[: seq + 1]
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    return [datum] * batch


def _tenant_run(
    sc: Any, seed: int, steps: int, batch: int, seq: int, barrier: threading.Barrier | None = None
) -> tuple[list[float], float]:
    """One tenant's run; returns its losses and the seconds of its training (after creation
    and, with ``barrier``, after every tenant is created)."""
    import tinker

    tc = sc.create_lora_training_client(base_model="base", rank=8, seed=seed).result()
    data = _data(tc.get_tokenizer(), batch, seq)
    if barrier is not None:
        barrier.wait()
    t0 = time.perf_counter()
    futures, steps_f = [], []
    for _ in range(steps):
        futures.append(tc.forward_backward(data, "cross_entropy"))
        steps_f.append(tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3)))
    losses = [f.result().metrics["loss:sum"] for f in futures]
    for f in steps_f:
        f.result()
    return losses, time.perf_counter() - t0


def _bytes(service: Any) -> dict[str, int]:
    base = next(iter(service._bases.values()))
    params = sum(p.numel() * p.element_size() for n, p in base.model.named_parameters())
    adapters = sum(
        p.numel() * p.element_size() for n, p in base.model.named_parameters() if ".lora_" in n
    )
    return {"all_params": params, "adapter_params": adapters, "base_params": params - adapters}


def part_tenants(
    model: Path, work: Path, n: int, steps: int, batch: int, seq: int
) -> dict[str, Any]:
    import tinker

    tokens = n * steps * batch * seq
    shared: dict[str, Any] = {}
    for batched in (False, True):
        svc = _service(model, work / f"shared{int(batched)}", batch_tenants=batched)
        sc = tinker.ServiceClient(base_url=svc.url)
        barrier = threading.Barrier(n + 1)
        threads, results = [], {}
        for i in range(n):
            th = threading.Thread(
                target=lambda i=i, sc=sc, b=barrier, r=results: r.__setitem__(
                    i, _tenant_run(sc, i, steps, batch, seq, b)
                )
            )
            th.start()
            threads.append(th)
        barrier.wait()  # every tenant created: time the training alone
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        train_s = time.perf_counter() - t0
        mem = _bytes(svc.service)
        per_op: dict[str, dict[str, float]] = {}
        for key, m in svc.service.metrics.items():
            op = key.split("/", 1)[1]
            agg = per_op.setdefault(op, {})
            for f, v in m.items():
                agg[f] = agg.get(f, 0.0) + v
        svc.stop()
        shared["batched" if batched else "one_at_a_time"] = {
            "train_s": train_s,
            "tokens_per_s": tokens / train_s,
            "per_operation": per_op,
            "losses": results,
        }

    separate_s = 0.0
    solo = {}
    for i in range(n):  # each its own service (its own base), one after another
        s = _service(model, work / f"solo{i}")
        solo[i] = _tenant_run(tinker.ServiceClient(base_url=s.url), i, steps, batch, seq)
        separate_s += solo[i][1]
        s.stop()
    adapter_each = mem["adapter_params"] // n
    opt_each = 2 * adapter_each  # Adam's two moments, float32 like the adapter
    out: dict[str, Any] = {"tenants": n, "steps": steps, "batch": batch, "seq": seq}
    for name, r in shared.items():
        losses = r.pop("losses")
        rel = max(
            abs(a - b) / abs(b)
            for i in range(n)
            for a, b in zip(losses[i][0], solo[i][0], strict=True)
        )
        out[f"shared_{name}"] = {**r, "max_rel_loss_diff_vs_solo": rel}
    out["separate"] = {"train_s_sum": separate_s, "tokens_per_s": tokens / separate_s}
    out["memory_bytes"] = {
        "shared": mem["base_params"] + n * (adapter_each + opt_each),
        "separate_side_by_side": n * (mem["base_params"] + adapter_each + opt_each),
        "base_params": mem["base_params"],
        "adapter_params_each": adapter_each,
    }
    return out


def part_overhead(model: Path, work: Path, reps: int) -> dict[str, Any]:
    import numpy as np
    import tinker
    from rl_tinker.backend import BaseModel, DatumInput, LoraSpec

    svc = _service(model, work / "overhead")
    sc = tinker.ServiceClient(base_url=svc.url)
    tc = sc.create_lora_training_client(base_model="base", rank=8).result()
    data = _data(tc.get_tokenizer(), 1, 64)
    adam = tinker.types.AdamParams(learning_rate=1e-4)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()
        times.append(time.perf_counter() - t0)
    svc.stop()
    service_s = statistics.median(times[2:])

    base = BaseModel("base", model)
    tenant = base.new_tenant("local", LoraSpec(rank=8))
    d = data[0]
    datum = DatumInput(
        tokens=np.asarray(d.model_input.to_ints(), dtype=np.int64),
        inputs={k: np.asarray(v.data) for k, v in d.loss_fn_inputs.items()},
    )
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        base.forward_backward(tenant, [datum], "cross_entropy", {}, backward=True)
        base.optim_step(tenant, adam.model_dump())
        times.append(time.perf_counter() - t0)
    local_s = statistics.median(times[2:])
    return {
        "reps": reps,
        "service_step_s": service_s,
        "in_process_step_s": local_s,
        "overhead_s": service_s - local_s,
        "overhead_ratio": service_s / local_s,
    }


def part_cookbook(model: Path, work: Path, rl_steps: int, sl_epochs: int) -> dict[str, Any]:
    from rl_tinker.recipes import cookbook

    svc = _service(model, work / "cookbook")
    try:
        t0 = time.perf_counter()
        sl = cookbook.supervised(svc.url, str(model), str(work / "sl"), num_epochs=sl_epochs)
        sl_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        rl = cookbook.rl(
            svc.url, str(model), str(work / "rl"), steps=rl_steps, batch_size=4, group_size=8
        )
        rl_s = time.perf_counter() - t0
    finally:
        svc.stop()
    return {
        "supervised": {
            "wall_s": sl_s,
            "train_mean_nll": [r["train_mean_nll"] for r in sl if "train_mean_nll" in r],
        },
        "rl": {
            "wall_s": rl_s,
            "reward": [r["env/all/reward/total"] for r in rl if "env/all/reward/total" in r],
        },
    }


def part_sampler(model: Path, reps: int, samples: int, tokens: int) -> dict[str, Any]:
    """Sampling seconds per ``sampler`` kind and the generator's own tensor bytes."""
    import numpy as np
    import torch
    from rl_tinker.backend import BaseModel, LoraSpec

    out: dict[str, Any] = {"samples": samples, "tokens": tokens, "reps": reps}
    for kind in ("policy", "hf"):
        base = BaseModel("base", model, sampler=kind)
        tenant = base.new_tenant("m", LoraSpec(rank=8))
        with torch.no_grad():
            for _, p in tenant.params:
                p.add_(torch.randn_like(p) * 0.01)
        prompt = np.asarray(base.tokenizer.encode("Once upon a time"), dtype=np.int64)
        weights = ("snap", tenant.lora, tenant.state_tensors())
        times = []
        for r in range(reps + 1):
            t0 = time.perf_counter()
            base.sample(
                prompt,
                weights=weights,
                num_samples=samples,
                max_tokens=tokens,
                temperature=1.0,
                top_k=-1,
                top_p=1.0,
                stop=[],
                seed=r,
                prompt_logprobs=False,
            )
            times.append(time.perf_counter() - t0)
        out[f"{kind}_sample_s"] = statistics.median(times[1:])
        if base.generator is not None:
            own = {t.data_ptr() for t in (*base.model.parameters(), *base.model.buffers())}
            gen = base.generator.generator.model
            out["generator_own_base_bytes"] = sum(
                t.numel() * t.element_size()
                for n, t in (*gen.named_parameters(), *gen.named_buffers())
                if ".lora_" not in n and t.data_ptr() not in own
            )
            out["base_bytes"] = sum(
                t.numel() * t.element_size()
                for n, t in base.model.named_parameters()
                if ".lora_" not in n
            )
            base.close()
    return out


def main() -> None:
    """Parse the options, run the parts, write the results file."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--part", choices=["all", "tenants", "overhead", "cookbook", "sampler"], default="all"
    )
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rl-steps", type=int, default=12)
    p.add_argument("--sl-epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--sample-tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "service.json"))
    args = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local-benchmark")
    load = os.getloadavg()
    out: dict[str, Any] = {"model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = _model_dir(args.model, work)
        if args.part in ("all", "tenants"):
            out["tenants"] = part_tenants(
                model, work, args.tenants, args.steps, args.batch, args.seq
            )
            print("tenants", out["tenants"], flush=True)
        if args.part in ("all", "overhead"):
            out["overhead"] = part_overhead(model, work, args.reps)
            print("overhead", out["overhead"], flush=True)
        if args.part in ("all", "cookbook"):
            out["cookbook"] = part_cookbook(model, work, args.rl_steps, args.sl_epochs)
            print("cookbook", out["cookbook"], flush=True)
        if args.part in ("all", "sampler"):
            out["sampler"] = part_sampler(model, 3, args.samples, args.sample_tokens)
            print("sampler", out["sampler"], flush=True)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write_results(Path(args.out), out, load)


if __name__ == "__main__":
    main()
