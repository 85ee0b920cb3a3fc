"""Weight-sync benchmark: delta size and codec speed, disk latency, broadcast vs raw broadcast.

A synthetic Llama-shaped model (~134M parameters: 268 MB in bf16, 536 MB in fp32) is updated by
real Adam steps (random gradients, lr 1e-6 and 1e-5, two warm-up steps then the measured step)
and by a random perturbation. For each served dtype and update it measures:

- bytes per version: full checkpoint vs XOR (``bytes`` layout) and overwrite deltas (zstd level 1);
  ``delta_ratio`` = delta bytes / full checkpoint bytes;
- encode and apply throughput in GB/s of model bytes with 1 and 2 threads;
- end-to-end publish-to-loaded latency of DiskDeltaTransport and DiskFullTransport;
- BroadcastTransport (bucketed, handshake) against a raw ``ProcessGroupGloo.broadcast`` of the
  same bytes between two processes on 127.0.0.1; ``broadcast_ratio`` = bucketed / raw throughput;
- adapter-only sync (``adapter_only``): a rank-16 LoRA adapter on all 7 projections of every
  layer, served in bf16 like the model, updated by Adam steps (lr 1e-5 and 1e-4): bytes per
  sync and publish/apply seconds of disk_full, disk_delta and broadcast, against the full model
  synced the same way in the same run; ``bytes_ratio`` = adapter bytes / full checkpoint bytes;
- xor payload layouts (``codec_layouts``): apply GB/s per core (thread CPU time), wall GB/s with
  1 and 2 threads, and in place, of the original single-frame layout (``bytes``) against byte
  planes (``planes``, ``auto``) at zstd levels 1 and -1 (planes also at 7), on 128 MB of
  synthetic N(0, 0.02) weights after a +-lr step (bf16 lr 1e-5, fp32 lr 1e-5, bf16 lr 1e-6),
  with delta/full ratios and encode GB/s.

Run: ``OMP_NUM_THREADS=1 python benchmarks/weightsync.py [--small] [--adapter-only]``.
``--codec-only`` measures and prints only the layouts (``--write`` replaces their entry). Writes
``benchmarks/results/weightsync.json``; ``--adapter-only`` measures only the adapter case and
replaces the ``adapter_only`` entry of the existing file (the other entries stay as they were
measured). Not a test; takes a few minutes on 2 cores (the adapter case alone about one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rl_core.lora import LoRAConfig, peft_name, with_adapter
from rl_core.types import WeightUpdate
from rl_weightsync._codec import layout_of
from rl_weightsync.checksum import tensor_bytes
from rl_weightsync.disk_delta import DiskDeltaTransport, decode_delta, encode_delta
from rl_weightsync.disk_full import DiskFullTransport

RESULTS = Path(__file__).with_name("results") / "weightsync.json"


def model_shapes(
    hidden: int, layers: int, ffn: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Llama names and shapes."""
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (hidden, hidden)),
            (p + "self_attn.v_proj.weight", (hidden, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (ffn, hidden)),
            (p + "mlp.up_proj.weight", (ffn, hidden)),
            (p + "mlp.down_proj.weight", (hidden, ffn)),
        ]
    return [*out, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def init_model(shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {}
    for name, shape in shapes:
        if len(shape) == 1:
            w[name] = torch.ones(shape) + 0.02 * torch.randn(shape, generator=g)
        else:
            w[name] = torch.randn(shape, generator=g) * (1.0 / shape[-1] ** 0.5)
    return w


def adam_versions(master: dict[str, torch.Tensor], lr: float) -> tuple[dict, dict]:
    """(weights before, weights after) the third Adam step with random gradients."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in master.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    g = torch.Generator().manual_seed(1)
    before = None
    for step in range(3):
        if step == 2:
            before = {k: p.detach().clone() for k, p in params.items()}
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    assert before is not None
    return before, {k: p.detach().clone() for k, p in params.items()}


def perturb(master: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(2)
    return master, {
        k: v + 1e-3 * torch.randn(v.shape, generator=g) * v.abs() for k, v in master.items()
    }


def _pool_map(fn, items, threads):
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def codec_case(old: dict, new: dict, dtype: torch.dtype) -> dict:
    old_b = {k: tensor_bytes(v.to(dtype)) for k, v in old.items()}
    new_b = {k: tensor_bytes(v.to(dtype)) for k, v in new.items()}
    isz = torch.empty((), dtype=dtype).element_size()
    full = sum(b.size for b in new_b.values())
    names = list(new_b)
    row: dict = {"full_bytes": full}
    for enc in ("xor", "overwrite"):
        for threads in (1, 2):
            t0 = time.perf_counter()
            blobs = _pool_map(
                lambda n, enc=enc: encode_delta(old_b[n], new_b[n], itemsize=isz, encoding=enc),
                names,
                threads,
            )
            dt = time.perf_counter() - t0
            row[f"{enc}_encode_gbps_{threads}t"] = full / dt / 1e9
        nbytes = sum(len(b) for b in blobs if b is not None)
        row[f"{enc}_bytes"] = nbytes
        row[f"{enc}_delta_ratio"] = nbytes / full
        pairs = [(n, b) for n, b in zip(names, blobs) if b is not None]
        for threads in (1, 2):
            t0 = time.perf_counter()
            outs = _pool_map(
                lambda nb, enc=enc: decode_delta(old_b[nb[0]], nb[1], itemsize=isz, encoding=enc),
                pairs,
                threads,
            )
            dt = time.perf_counter() - t0
            row[f"{enc}_apply_gbps_{threads}t"] = full / dt / 1e9
        assert all(o.tobytes() == new_b[n].tobytes() for (n, _), o in zip(pairs[:3], outs[:3]))
    row["delta_ratio"] = row["xor_delta_ratio"]
    return row


LAYOUT_CASES = (
    ("bf16_lr1e-5", torch.bfloat16, 1e-5),
    ("fp32_lr1e-5", torch.float32, 1e-5),
    ("bf16_lr1e-6", torch.bfloat16, 1e-6),
)
LAYOUT_VARIANTS = (
    ("bytes", 1),
    ("bytes", -1),
    ("planes", 1),
    ("planes", -1),
    ("planes", 7),
    ("auto", 1),
)


def _step_bytes(nbytes: int, dtype: torch.dtype, lr: float, seed: int) -> tuple:
    """Raw bytes of N(0, 0.02) weights before and after an Adam-like +-lr step on every element."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    step = torch.where(torch.rand(n, generator=g) < 0.5, -lr, lr)
    return tensor_bytes(w.to(dtype)), tensor_bytes((w + step).to(dtype))


def _decode_all(items: list, isz: int, threads: int, into: list | None = None) -> list:
    """Decode every (pair, blob, layout) of ``items``; in place into ``into`` when given."""
    if into is not None:
        return [
            decode_delta(c, b, itemsize=isz, encoding="xor", layout=u, out=c)
            for (_, b, u), c in zip(items, into)
        ]

    def one(item):
        (o, _), b, u = item
        return decode_delta(o, b, itemsize=isz, encoding="xor", layout=u)

    return [one(it) for it in items] if threads == 1 else _pool_map(one, items, threads)


def codec_layouts(total_bytes: int, tensors: int = 4, reps: int = 7) -> list[dict]:
    """Apply (decode) throughput and size of the xor layouts (``bytes``: the original single
    zstd frame; ``planes``; ``auto``) at zstd levels 1 and -1 (planes also at 7: slower to
    encode, fewer and longer matches to decode), on ``tensors`` synthetic tensors
    of ``total_bytes`` in all per case.

    ``apply_gbps_1t_cpu`` = model bytes / CPU seconds of the decoding thread (per core, and the
    least disturbed by other work on the machine); ``apply_gbps_1t`` and ``apply_gbps_2t`` are
    wall-clock with 1 and 2 threads over the tensors; ``apply_inplace_gbps_1t_cpu`` decodes into
    a copy of the old bytes (``out=old``), as ``DiskDeltaTransport`` does with the bytes it reads. Variants are interleaved within each of
    ``reps`` rounds; each number is the best round.
    """
    rows = []
    for case, dtype, lr in LAYOUT_CASES:
        isz = torch.empty((), dtype=dtype).element_size()
        pairs = [_step_bytes(total_bytes // tensors, dtype, lr, seed) for seed in range(tensors)]
        full = sum(o.size for o, _ in pairs)
        blobs, encode_s = {}, {}
        for layout, level in LAYOUT_VARIANTS:
            c0 = time.thread_time()
            enc = [
                encode_delta(o, n, itemsize=isz, encoding="xor", level=level, layout=layout)
                for o, n in pairs
            ]
            encode_s[layout, level] = time.thread_time() - c0
            used = [layout_of(b) for b in enc]
            for (o, n), b, u in zip(pairs, enc, used):
                out = decode_delta(o, b, itemsize=isz, encoding="xor", layout=u)
                assert out.tobytes() == n.tobytes(), (case, layout, level)
            blobs[layout, level] = list(zip(pairs, enc, used))
        best = {v: {"cpu1": 1e9, "wall1": 1e9, "wall2": 1e9, "inplace": 1e9} for v in blobs}

        for _ in range(reps):
            for v, items in blobs.items():
                c0, t0 = time.thread_time(), time.perf_counter()
                _decode_all(items, isz, 1)
                c1, t1 = time.thread_time(), time.perf_counter()
                best[v]["cpu1"] = min(best[v]["cpu1"], c1 - c0)
                best[v]["wall1"] = min(best[v]["wall1"], t1 - t0)
                t0 = time.perf_counter()
                _decode_all(items, isz, 2)
                best[v]["wall2"] = min(best[v]["wall2"], time.perf_counter() - t0)
                copies = [o.copy() for (o, _), _, _ in items]  # as the receiver reads them
                c0 = time.thread_time()
                _decode_all(items, isz, 1, into=copies)
                best[v]["inplace"] = min(best[v]["inplace"], time.thread_time() - c0)
                del copies
        for (layout, level), items in blobs.items():
            b = best[layout, level]
            rows.append(
                {
                    "case": case,
                    "layout": layout,
                    "zstd_level": level,
                    "layouts_used": sorted({u for *_, u in items}),
                    "full_bytes": full,
                    "delta_ratio": sum(len(blob) for _, blob, _ in items) / full,
                    "apply_gbps_1t_cpu": full / b["cpu1"] / 1e9,
                    "apply_gbps_1t": full / b["wall1"] / 1e9,
                    "apply_gbps_2t": full / b["wall2"] / 1e9,
                    "apply_inplace_gbps_1t_cpu": full / b["inplace"] / 1e9,
                    "encode_gbps_1t_cpu": full / encode_s[layout, level] / 1e9,
                }
            )
        del pairs, blobs
    return rows


def layouts_entry(rows: list[dict], bytes_per_case: int, load_before: float) -> dict:
    """The ``codec_layouts`` entry of the results file (load average now taken as "after")."""
    return {
        "bytes_per_case": bytes_per_case,
        "rows": rows,
        "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
    }


def print_layouts(rows: list[dict]) -> None:
    """The codec-layout table (one row per case, layout and zstd level; GB/s)."""
    hdr = f"{'case':12s} {'layout':7s} {'lvl':>3s} {'delta/full':>10s} {'apply 1t cpu':>12s} {'1t wall':>8s} {'2t wall':>8s} {'in place 1t cpu':>15s} {'encode 1t cpu':>13s}  (GB/s)"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        print(
            f"{r['case']:12s} {r['layout']:7s} {r['zstd_level']:3d} {r['delta_ratio']:10.3f} "
            f"{r['apply_gbps_1t_cpu']:12.2f} {r['apply_gbps_1t']:8.2f} {r['apply_gbps_2t']:8.2f} "
            f"{r['apply_inplace_gbps_1t_cpu']:15.2f} {r['encode_gbps_1t_cpu']:13.2f}"
        )


def disk_latency(old: dict, new: dict, serve: str, root: Path) -> dict:
    """Publish-to-loaded seconds for disk_delta (delta step) and disk_full."""

    class Target:
        def __init__(self) -> None:
            self.v = 0

        @property
        def weight_version(self) -> int:
            return self.v

        def load_weights(self, named, *, version):
            for _ in named:
                pass
            self.v = version

    out = {}
    cfg = {"directory": root / "delta", "serve_dtype": serve, "num_threads": 2}
    snd = DiskDeltaTransport(DiskDeltaTransport.Config(**cfg))
    rcv = DiskDeltaTransport(DiskDeltaTransport.Config(**cfg, local_dir=root / "local"))
    tgt = Target()
    rcv.apply(snd.publish(1, old.items()), tgt)
    t0 = time.perf_counter()
    u = snd.publish(2, new.items())
    t1 = time.perf_counter()
    rcv.apply(u, tgt)
    t2 = time.perf_counter()
    out.update(delta_publish_s=t1 - t0, delta_apply_s=t2 - t1, delta_e2e_s=t2 - t0)
    full = DiskFullTransport(DiskFullTransport.Config(directory=root / "full", serve_dtype=serve))
    t0 = time.perf_counter()
    u = full.publish(2, new.items())
    t1 = time.perf_counter()
    full.apply(u, Target())
    t2 = time.perf_counter()
    out.update(full_publish_s=t1 - t0, full_apply_s=t2 - t1, full_e2e_s=t2 - t0)
    return out


# -- adapter-only sync ----------------------------------------------------------------------------


class _Sink:
    """A target that reads every tensor it is given (the cost an engine's loader pays)."""

    def __init__(self, version: int = 0) -> None:
        self.v = version

    @property
    def weight_version(self) -> int:
        return self.v

    def load_weights(self, named, *, version):
        for _ in named:
            pass
        self.v = version


def adapter_weights(master: dict, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """A trained-looking adapter (peft names): A ~ N(0, 1/in), B ~ N(0, 1e-3^2) (B starts at zero
    in training and has moved)."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, w in master.items():
        module = name.removesuffix(".weight")
        if w.dim() != 2 or not name.endswith(".weight") or not lora.targets(module):
            continue
        out_f, in_f = w.shape
        out[peft_name(module, "A")] = torch.randn(lora.rank, in_f, generator=g) / in_f**0.5
        out[peft_name(module, "B")] = torch.randn(out_f, lora.rank, generator=g) * 1e-3
    return out


def _timed_sync(sender, receiver, version: int, tensors: dict, meta: dict | None) -> dict:
    t0 = time.perf_counter()
    u = sender.publish(version, tensors.items(), metadata=meta)
    t1 = time.perf_counter()
    receiver.apply(u, _Sink(version - 1))
    t2 = time.perf_counter()
    return {
        "kind": u.metadata.get("kind", "full"),
        "bytes": u.metadata["bytes"],
        "publish_s": t1 - t0,
        "apply_s": t2 - t1,
        "e2e_s": t2 - t0,
    }


def sync_bytes_and_times(old: dict, new: dict, root: Path, meta: dict | None) -> dict:
    """disk_full of ``new``, and disk_delta from ``old`` to ``new``, served in bf16."""
    full_cfg = {"directory": root / "full", "serve_dtype": "bfloat16"}
    full = _timed_sync(
        DiskFullTransport(DiskFullTransport.Config(**full_cfg)),
        DiskFullTransport(DiskFullTransport.Config(**full_cfg)),
        2,
        new,
        meta,
    )
    cfg = {"directory": root / "delta", "serve_dtype": "bfloat16", "num_threads": 2}
    snd = DiskDeltaTransport(DiskDeltaTransport.Config(**cfg))
    rcv = DiskDeltaTransport(DiskDeltaTransport.Config(**cfg, local_dir=root / "local"))
    rcv.apply(snd.publish(1, old.items(), metadata=meta), _Sink())
    delta = _timed_sync(snd, rcv, 2, new, meta)
    assert delta["kind"] == "delta"
    return {"disk_full": full, "disk_delta": delta}


def adapter_case(master: dict, rank: int = 16) -> dict:
    """Adapter-only sync against full-weights sync of the same model, both in bf16."""
    lora = LoRAConfig(rank=rank, alpha=2.0 * rank)  # all 7 projection types (the default)
    adapter = adapter_weights(master, lora)
    meta = dict(
        with_adapter(WeightUpdate(version=0, base_version=None, transport=""), lora).metadata
    )
    a_params = sum(t.numel() for t in adapter.values())
    m_params = sum(t.numel() for t in master.values())
    out: dict = {
        "rank": rank,
        "target_modules": list(lora.target_modules),
        "serve_dtype": "bfloat16",
        "adapter_params": a_params,
        "model_params": m_params,
        "param_ratio": a_params / m_params,
    }
    with tempfile.TemporaryDirectory() as d:
        old, new = adam_versions(master, 1e-5)
        out["full_model"] = {
            "update": "adam_lr1e-5",
            **sync_bytes_and_times(old, new, Path(d) / "m", None),
        }
        del old, new
    full_bytes = out["full_model"]["disk_full"]["bytes"]
    out["full_checkpoint_bytes"] = full_bytes
    out["adapter"] = {}
    for lr in (1e-5, 1e-4):
        old, new = adam_versions(adapter, lr)
        with tempfile.TemporaryDirectory() as d:
            row = sync_bytes_and_times(old, new, Path(d), meta)
        for r in row.values():
            r["bytes_ratio"] = r["bytes"] / full_bytes
        out["adapter"][f"adam_lr{lr:.0e}".replace("e-0", "e-")] = row
    out["bytes_ratio_full_adapter"] = out["adapter"]["adam_lr1e-5"]["disk_full"]["bytes_ratio"]
    out["bytes_ratio_delta_adapter"] = {
        k: v["disk_delta"]["bytes_ratio"] for k, v in out["adapter"].items()
    }
    a_bytes = out["adapter"]["adam_lr1e-5"]["disk_full"]["bytes"]
    out["broadcast"] = {
        "adapter": broadcast_case(a_bytes, bucket=64 << 20, reps=3),
        "full_model": broadcast_case(full_bytes, bucket=64 << 20, reps=3),
    }
    out["target_max_bytes_ratio"] = 0.02
    return out


def print_adapter(a: dict) -> None:
    print(
        f"\nadapter-only, rank {a['rank']} on {len(a['target_modules'])} projection types: "
        f"{a['adapter_params'] / 1e6:.2f}M params = {100 * a['param_ratio']:.2f}% of the model's"
    )
    fm = a["full_model"]
    print(
        f"  full model bf16 (adam lr 1e-5): disk_full {fm['disk_full']['bytes'] / 1e6:.1f} MB "
        f"{fm['disk_full']['e2e_s']:.2f}s, disk_delta {fm['disk_delta']['bytes'] / 1e6:.1f} MB "
        f"{fm['disk_delta']['e2e_s']:.2f}s"
    )
    for upd, row in a["adapter"].items():
        for tname, r in row.items():
            print(
                f"  adapter {upd:11s} {tname:10s} {r['bytes'] / 1e6:7.3f} MB = "
                f"{100 * r['bytes_ratio']:.3f}% of the full checkpoint, publish {r['publish_s']:.3f}s "
                f"+ apply {r['apply_s']:.3f}s = {r['e2e_s']:.3f}s"
            )
    for what, b in a["broadcast"].items():
        print(f"  broadcast {what:10s} {b['bytes'] / 1e6:7.1f} MB: {b['bucketed_s']:.3f}s")


# -- broadcast: two processes ---------------------------------------------------------------------


def _bcast_peer(rank: int, port: int, nbytes: int, bucket: int, reps: int) -> None:
    import torch.distributed as dist

    from rl_weightsync.broadcast import BroadcastTransport

    torch.set_num_threads(1)
    t = BroadcastTransport(
        BroadcastTransport.Config(
            rank=rank, world_size=2, port=port, bucket_bytes=bucket, timeout_s=120
        )
    )
    n_el = nbytes // 2
    rows = 1024
    w = {f"w{i}": torch.randn(rows, n_el // rows // 16).to(torch.bfloat16) for i in range(16)}
    total = sum(x.numel() * 2 for x in w.values())
    if rank == 0:
        t._connect_store()
    t.connect()
    pg, store = t._pg, t._store
    flat = torch.empty(total, dtype=torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    raw, ours = [], []
    for _ in range(reps + 1):  # first is warm-up (page faults in fresh buffers)
        pg.broadcast([torch.zeros(1)], opts).wait()
        t0 = time.perf_counter()
        pg.broadcast([flat], opts).wait()
        raw.append(time.perf_counter() - t0)
    for v in range(1, reps + 2):
        if rank == 0:
            t.publish(v, w.items())
            store.wait([f"done/{v}"])
        else:
            store.wait([f"header/{v}"])
            t0 = time.perf_counter()
            list(
                t.receive(
                    WeightUpdate(version=v, base_version=None, transport="broadcast"),
                    current_version=v - 1,
                )
            )
            ours.append(time.perf_counter() - t0)
            store.set(f"done/{v}", "1")
    if rank == 1:
        print(
            json.dumps({"bytes": total, "raw_s": min(raw[1:]), "bucketed_s": min(ours[1:])}),
            flush=True,
        )
    t.close()


def broadcast_case(nbytes: int, bucket: int, reps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--peer"]
    procs = [
        subprocess.Popen(
            [*cmd, str(r), str(port), str(nbytes), str(bucket), str(reps)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    out = procs[1].communicate(timeout=300)[0]
    procs[0].wait(timeout=60)
    res = json.loads(out.strip().splitlines()[-1])
    res["raw_gbps"] = res["bytes"] / res["raw_s"] / 1e9
    res["bucketed_gbps"] = res["bytes"] / res["bucketed_s"] / 1e9
    res["broadcast_ratio"] = res["bucketed_gbps"] / res["raw_gbps"]
    res["bucket_bytes"] = bucket
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a ~20M-parameter model (quick check)")
    ap.add_argument(
        "--adapter-only",
        action="store_true",
        help="measure only the adapter-only case; replace its entry in the results file",
    )
    ap.add_argument(
        "--codec-only",
        action="store_true",
        help="measure only the xor layouts (codec_layouts) and print them; with --write also "
        "replace that entry of the results file",
    )
    ap.add_argument("--write", action="store_true", help="with --codec-only: update the file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    layout_bytes = (32 << 20) if args.small else (128 << 20)
    if args.codec_only:
        layouts = codec_layouts(layout_bytes)
        print_layouts(layouts)
        entry = layouts_entry(layouts, layout_bytes, load_before[0])
        print(
            "load average (1 min) before/after: {:.2f}/{:.2f}".format(
                *entry["loadavg_1m_before_after"]
            )
        )
        if args.write:
            result = json.loads(RESULTS.read_text())
            result["codec_layouts"] = entry
            RESULTS.write_text(json.dumps(result, indent=2) + "\n")
            print(f"updated codec_layouts in {RESULTS}")
        return
    dims = (256, 4, 704, 8000) if args.small else (768, 12, 2048, 32000)
    shapes = model_shapes(*dims)
    master = init_model(shapes)
    n_params = sum(v.numel() for v in master.values())
    print(
        f"model: {n_params / 1e6:.0f}M params, {n_params * 2 / 1e6:.0f} MB bf16, {n_params * 4 / 1e6:.0f} MB fp32"
    )
    if args.adapter_only:
        adapter = adapter_case(master)
        print_adapter(adapter)
        if not RESULTS.exists():
            raise SystemExit(f"{RESULTS} does not exist; run the whole benchmark first")
        result = json.loads(RESULTS.read_text())
        if result["model"]["params"] != n_params:
            raise SystemExit(
                f"{RESULTS} was measured on a {result['model']['params']}-parameter model, this "
                f"run on {n_params}; run the whole benchmark with the same --small setting"
            )
        result["adapter_only"] = {
            **adapter,
            "machine": {
                "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
                "torch": torch.__version__,
            },
        }
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"updated adapter_only in {RESULTS}")
        return
    updates = {
        "adam_lr1e-6": lambda: adam_versions(master, 1e-6),
        "adam_lr1e-5": lambda: adam_versions(master, 1e-5),
        "perturb_1e-3": lambda: perturb(master),
    }
    cases = []
    for uname, make in updates.items():
        old, new = make()
        for dtype in (torch.bfloat16, torch.float32):
            row = {
                "update": uname,
                "dtype": str(dtype).removeprefix("torch."),
                **codec_case(old, new, dtype),
            }
            cases.append(row)
            print(
                f"  {uname:13s} {row['dtype']:8s} xor {row['xor_delta_ratio']:.4f} ow {row['overwrite_delta_ratio']:.4f}",
                flush=True,
            )
        if uname == "adam_lr1e-5":
            with tempfile.TemporaryDirectory() as d:
                latency = {
                    "update": uname,
                    "serve_dtype": "bfloat16",
                    **disk_latency(old, new, "bfloat16", Path(d)),
                }
        del old, new
    layouts = codec_layouts(layout_bytes)
    bnbytes = (32 << 20) if args.small else (256 << 20)
    bcast = broadcast_case(bnbytes, bucket=64 << 20, reps=3)
    adapter = adapter_case(master)

    hdr = f"{'update':13s} {'dtype':8s} {'full MB':>8s} {'xor %':>7s} {'ovw %':>7s} {'xor enc 1t/2t GB/s':>19s} {'xor apply 1t/2t':>16s} {'ovw enc/apply 1t':>17s}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in cases:
        print(
            f"{r['update']:13s} {r['dtype']:8s} {r['full_bytes'] / 1e6:8.0f} {100 * r['xor_delta_ratio']:6.2f}% {100 * r['overwrite_delta_ratio']:6.2f}% "
            f"{r['xor_encode_gbps_1t']:9.2f}/{r['xor_encode_gbps_2t']:<9.2f} {r['xor_apply_gbps_1t']:7.2f}/{r['xor_apply_gbps_2t']:<8.2f} "
            f"{r['overwrite_encode_gbps_1t']:8.2f}/{r['overwrite_apply_gbps_1t']:<8.2f}"
        )
    print(
        f"\ndisk latency (bf16, adam lr 1e-5): delta publish {latency['delta_publish_s']:.2f}s + apply {latency['delta_apply_s']:.2f}s "
        f"= {latency['delta_e2e_s']:.2f}s; full publish {latency['full_publish_s']:.2f}s + load {latency['full_apply_s']:.2f}s = {latency['full_e2e_s']:.2f}s"
    )
    print(
        f"broadcast {bcast['bytes'] / 1e6:.0f} MB: raw gloo {bcast['raw_gbps']:.2f} GB/s, bucketed transport {bcast['bucketed_gbps']:.2f} GB/s, "
        f"broadcast_ratio {bcast['broadcast_ratio']:.2f}"
    )
    print_adapter(adapter)
    print_layouts(layouts)
    result = {
        "benchmark": "weightsync",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            # Other work on the machine depresses every throughput: read them with this.
            "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "model": {
            "params": n_params,
            "hidden": dims[0],
            "layers": dims[1],
            "ffn": dims[2],
            "vocab": dims[3],
        },
        "codec_cases": cases,
        "disk_latency": latency,
        "broadcast": bcast,
        "broadcast_ratio": bcast["broadcast_ratio"],
        "adapter_only": adapter,
        "codec_layouts": layouts_entry(layouts, layout_bytes, load_before[0]),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        _bcast_peer(*(int(x) for x in sys.argv[2:7]))
    else:
        main()
