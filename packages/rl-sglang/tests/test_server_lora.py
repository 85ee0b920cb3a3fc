"""LoRA adapters on a real CPU SGLang server (``enable_lora``, ``/load_lora_adapter``,
``/unload_lora_adapter``, ``lora_path`` per request): sampled tokens' log-probs equal
transformers with the adapter merged into the base weights. On the session server (launched
with LoRA serving on, see ``conftest.py``), through one attached generator for the module.

The adapters are written in peft's format by hand (``adapter_config.json`` +
``adapter_model.safetensors``): peft is not a dependency of rl-sglang."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl_core.errors import GenerationError, WeightSyncError
from rl_core.types import GenerationRequest, GenerationResult, SamplingParams
from rl_sglang import SGLangGenerator

P = (5, 17, 42, 99, 3, 120, 64, 7, 250, 31, 11, 2)
RANK, ALPHA = 4, 8


def _write_adapter(base: Path, out: Path, seed: int) -> Path:
    """A random rank-4 peft adapter on q_proj and v_proj of every layer of ``base``."""
    cfg = json.loads((base / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": hidden, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, width in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, RANK, generator=gen) * 0.3
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": sorted(outs),
        "bias": "none",
        "base_model_name_or_path": str(base),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _merged_logprobs(base: Path, adapter: Path | None, tokens: list[int]) -> torch.Tensor:
    """``log p(tokens[t] | tokens[:t])`` for t >= 1 from transformers, the adapter merged."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    if adapter is not None:
        state = model.state_dict()
        for key, a in load_file(str(adapter / "adapter_model.safetensors")).items():
            if key.endswith("lora_A.weight"):
                b = load_file(str(adapter / "adapter_model.safetensors"))[
                    key.replace("lora_A", "lora_B")
                ]
                name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                state[name] = state[name] + (ALPHA / RANK) * b @ a
        model.load_state_dict(state)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp_TV.gather(1, ids[0, 1:, None]).squeeze(1)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different adapters of the tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return {n: _write_adapter(tiny_model, root / n, seed=s) for n, s in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def lora_gen(
    owner: SGLangGenerator, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangGenerator]:
    """A generator attached to the session server (LoRA serving on), rewound to the base
    weights at version 0; the adapters it loaded are unloaded after the module."""
    gen = SGLangGenerator(
        SGLangGenerator.Config(
            server_urls=tuple(owner.server_urls),
            log_dir=str(tmp_path_factory.mktemp("sglang-lora-logs")),
            health_interval_s=0,
        )
    )
    gen.load_weights_from_disk(str(tiny_model), version=0)
    yield gen
    for name in gen.lora_adapters:
        asyncio.run(gen.unload_lora_adapter(name))
    asyncio.run(gen.close())


def _max_err(
    base: Path, adapter: Path | None, req: GenerationRequest, res: GenerationResult
) -> float:
    ref = _merged_logprobs(base, adapter, list(req.input_ids + res.output_ids))
    got = torch.tensor(res.output_logprobs)
    return float((ref[len(req.input_ids) - 1 :] - got).abs().max())


def test_adapters_per_request_match_merged_weights(
    lora_gen: SGLangGenerator, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """One batch mixing the base model and two adapters: every request's sampled log-probs
    equal transformers with its own adapter merged (and differ from the base model's)."""
    assert lora_gen.supports_lora
    for name, path in adapters.items():
        asyncio.run(lora_gen.load_lora_adapter(name, str(path)))
    assert lora_gen.lora_adapters == {n: str(p) for n, p in adapters.items()}
    names = [None, "a", "b", "a"]
    reqs = [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=P[: 5 + i],
            sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
        )
        for i in range(len(names))
    ]
    results = asyncio.run(lora_gen.generate(reqs, lora_adapter=names))
    errs = []
    for name, req, res in zip(names, reqs, results):
        assert res.output_ids
        adapter = adapters[name] if name else None
        errs.append(_max_err(tiny_model, adapter, req, res))
        if name:  # the adapter really changes the model
            assert _max_err(tiny_model, None, req, res) > 1e-2
    print(f"max |log-prob - merged HF| per request (base, a, b, a): {errs}")
    assert max(errs) < 1e-3


def test_replace_unload_and_default_adapter(
    lora_gen: SGLangGenerator, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """Loading a name again replaces its weights (publishing a new adapter version), the default
    adapter applies to requests that name none, and an unloaded name is refused."""
    asyncio.run(lora_gen.load_lora_adapter("a", str(adapters["a"])))
    asyncio.run(lora_gen.load_lora_adapter("a", str(adapters["b"])))  # new weights, same name
    lora_gen.default_lora_adapter = "a"
    req = GenerationRequest(
        request_id="d", input_ids=P, sampling=SamplingParams(max_new_tokens=5, temperature=1.0)
    )
    (res,) = asyncio.run(lora_gen.generate([req]))
    assert _max_err(tiny_model, adapters["b"], req, res) < 1e-3
    asyncio.run(lora_gen.unload_lora_adapter("a"))
    assert lora_gen.default_lora_adapter is None and "a" not in lora_gen.lora_adapters
    with pytest.raises(GenerationError, match="no LoRA adapter named 'a'"):
        asyncio.run(lora_gen.generate([req], lora_adapter="a"))
    with pytest.raises(GenerationError, match="adapter_config.json"):
        asyncio.run(lora_gen.load_lora_adapter("c", str(tiny_model)))


def _merged_ref(base: Path, adapter: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of transformers with ``adapter`` merged by
    :func:`rl_core.lora.merge_adapter` (the reference for adapter-only updates)."""
    from transformers import AutoModelForCausalLM

    from rl_core.lora import LoRAConfig, merge_adapter

    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=("q_proj", "v_proj"))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    state = model.state_dict()
    state.update(merge_adapter(state, adapter, lora))
    model.load_state_dict(state)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp_TV.gather(1, ids[0, 1:, None]).squeeze(1)


def _served_models(gen: SGLangGenerator) -> set[str]:
    """Model ids the server lists (base model and loaded adapters), from ``/v1/models``."""
    import urllib.request

    with urllib.request.urlopen(gen.server_urls[0] + "/v1/models", timeout=30) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def test_adapter_updates_through_disk_delta(
    lora_gen: SGLangGenerator,
    tiny_model: Path,
    adapters: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Adapter-only updates v1 (full) then v2 (a delta on v1) through disk_delta: the served
    log-probs follow each version and match the base with that version merged; the weight version
    follows the update; v1 is unloaded from the server once v2 is in."""
    from rl_core.lora import LoRAConfig, with_adapter
    from rl_weightsync import DiskDeltaTransport

    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=("q_proj", "v_proj"), name="policy")
    sync = tmp_path / "sync"
    sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync))
    receiver = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=sync, local_dir=tmp_path / "local")
    )
    versions = {
        v: load_file(str(adapters[n] / "adapter_model.safetensors"))
        for v, n in ((1, "a"), (2, "b"))
    }
    start = lora_gen.weight_version
    req = GenerationRequest(
        request_id="u", input_ids=P, sampling=SamplingParams(max_new_tokens=6, temperature=1.0)
    )
    errs = {}
    for i, (v, tensors) in enumerate(versions.items()):
        version = start + 1 + i
        update = with_adapter(sender.publish(version, tensors.items()), lora, str(tiny_model))
        assert update.metadata["kind"] == ("full" if i == 0 else "delta")
        asyncio.run(lora_gen.update_weights(update, receiver))
        assert lora_gen.weight_version == version
        assert lora_gen.lora_versions == {"policy": f"policy-v{version}"}
        assert lora_gen.default_lora_adapter == f"policy-v{version}"
        (res,) = asyncio.run(lora_gen.generate([req]))  # the new adapter by default
        assert res.output_ids and res.weight_version == version
        tokens = list(req.input_ids + res.output_ids)
        got = torch.tensor(res.output_logprobs)
        ref = _merged_ref(tiny_model, tensors, tokens)[len(req.input_ids) - 1 :]
        errs[v] = float((ref - got).abs().max())
        other = versions[3 - v]
        other_ref = _merged_ref(tiny_model, other, tokens)[len(req.input_ids) - 1 :]
        assert float((other_ref - got).abs().max()) > 1e-2  # the outputs changed with the version
        (named,) = asyncio.run(lora_gen.generate([req], lora_adapter="policy"))
        assert named.weight_version == version
    print(f"SGLang CPU LoRA via adapter updates: max |log-prob - merged HF| per version: {errs}")
    assert max(errs.values()) < 1e-3
    served = _served_models(lora_gen)
    assert f"policy-v{start + 2}" in served and f"policy-v{start + 1}" not in served
    assert f"policy-v{start + 1}" not in lora_gen.lora_adapters
    assert not Path(lora_gen.log_dir / "adapters" / f"policy-v{start + 1}").exists()
    # a replay is refused and changes nothing
    with pytest.raises(WeightSyncError, match="refused"):
        asyncio.run(lora_gen.update_weights(update, receiver))
    assert lora_gen.weight_version == start + 2
    sender.close()
    receiver.close()


def test_multi_adapter_update_and_adapter_per_request(
    lora_gen: SGLangGenerator,
    tiny_model: Path,
    adapters: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Multi-LoRA: one update carrying two adapters (``solver``, ``critic``) loads both under
    their versioned names, and each request's own ``adapter`` picks its adapter: the sampled
    log-probs match the base with that adapter merged, not the other."""
    from rl_core.lora import LoRAConfig, adapter_tensor_name, with_adapter
    from rl_weightsync import DiskDeltaTransport

    lora = LoRAConfig(
        rank=RANK, alpha=ALPHA, target_modules=("q_proj", "v_proj"), adapters=("solver", "critic")
    )
    sync = tmp_path / "sync"
    sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync))
    receiver = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=sync, local_dir=tmp_path / "local")
    )
    own = {
        "solver": load_file(str(adapters["a"] / "adapter_model.safetensors")),
        "critic": load_file(str(adapters["b"] / "adapter_model.safetensors")),
    }
    tensors = [(adapter_tensor_name(a, n), t) for a, ts in own.items() for n, t in ts.items()]
    version = lora_gen.weight_version + 1
    update = with_adapter(sender.publish(version, tensors), lora, str(tiny_model))
    asyncio.run(lora_gen.update_weights(update, receiver))
    assert lora_gen.weight_version == version
    versions = lora_gen.lora_versions
    assert versions["solver"] == f"solver-v{version}" and versions["critic"] == f"critic-v{version}"
    names = ["critic", "solver", "critic"]
    reqs = [
        GenerationRequest(
            request_id=f"m{i}",
            input_ids=P[: 6 + i],
            sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
            adapter=name,
        )
        for i, name in enumerate(names)
    ]
    results = asyncio.run(lora_gen.generate(reqs))
    errs = []
    for name, req, res in zip(names, reqs, results, strict=True):
        tokens = list(req.input_ids + res.output_ids)
        got = torch.tensor(res.output_logprobs)
        ref = _merged_ref(tiny_model, own[name], tokens)[len(req.input_ids) - 1 :]
        errs.append(float((ref - got).abs().max()))
        other = own["solver" if name == "critic" else "critic"]
        other_ref = _merged_ref(tiny_model, other, tokens)[len(req.input_ids) - 1 :]
        assert float((other_ref - got).abs().max()) > 1e-2
    print(f"SGLang CPU multi-LoRA: max |log-prob - merged HF| per request: {errs}")
    assert max(errs) < 1e-3
    with pytest.raises(GenerationError, match="no LoRA adapter named 'nope'"):
        asyncio.run(
            lora_gen.generate([GenerationRequest(request_id="x", input_ids=P, adapter="nope")])
        )
    sender.close()
    receiver.close()
