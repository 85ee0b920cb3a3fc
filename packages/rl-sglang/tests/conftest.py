"""Session fixtures: SGLang installed in its own venv, a tiny model, ONE real SGLang server.

The server (CPU, stub CUDA driver) is launched once per session by an owning
:class:`SGLangGenerator` (``owner``); most tests attach to it with their own generator, after
rewinding it to the base weights at version 0. Startup takes about a minute and ~4 GB RSS. The
server runs with LoRA serving on (``enable_lora``, rank <= 8 on ``q_proj``/``v_proj``), so the
LoRA tests share it instead of starting a server of their own (one start less, ~60-100 s on two
cores); base-model requests (no adapter) are unaffected (``test_server_lora.py`` checks them
against transformers in the same batch as adapter requests). The modules that use it run first
(``test_recovery.py``, which kills and restarts it, last of them); it is stopped before the
other modules (some launch servers of their own). The SGLang tests are not optional: if SGLang
cannot be installed the session fails with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_hf import TinyModelSpec, build_tiny_model
from rl_sglang import SGLangGenerator, _cpu_support

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order this directory's modules (those on the session server first, a
    ``SESSION_SERVER_LAST`` one last of them, then the others, each group in name order; other
    directories' tests keep their places); skip ``gpu``-marked tests when CUDA is unavailable."""
    slots = [i for i, item in enumerate(items) if _HERE in Path(item.path).parents]
    users = {item.path for i in slots if _uses_owner(item := items[i])}
    mine = sorted(
        (items[i] for i in slots), key=lambda item: (item.path not in users, _runs_last(item))
    )
    for i, item in zip(slots, mine):
        items[i] = item
    _SESSION_MODULES.update(users)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sglang_python(untimed: Callable) -> str:
    """Run scripts/setup_sglang_env.sh (fast when cached); the SGLang venv's interpreter. The
    first install (~15 min) runs outside the per-test timeout (root ``conftest.py``)."""
    script = _cpu_support.setup_script()
    with untimed():
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        pytest.fail(
            f"SGLang is required by the rl-sglang tests and {script} failed (exit "
            f"{proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    py = _cpu_support.default_python()
    assert py.exists(), f"{script} succeeded but {py} is missing"
    return str(py)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 (hidden 64, 2 layers) with the local tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec(seed=0))


@pytest.fixture(scope="session")
def base_weights(tiny_model: Path) -> dict[str, torch.Tensor]:
    """The tiny model's weights (version 0)."""
    return load_file(str(tiny_model / "model.safetensors"))


@pytest.fixture(scope="session")
def owner(
    sglang_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangGenerator]:
    """The session's SGLang server, launched and owned by this generator."""
    gen = SGLangGenerator(
        SGLangGenerator.Config(
            model_path=str(tiny_model),
            python=sglang_python,
            log_dir=str(tmp_path_factory.mktemp("sglang-logs")),
            server_args={"log_level": "warning"},
            enable_lora=True,
            max_lora_rank=8,
            lora_target_modules=("q_proj", "v_proj"),
            health_interval_s=1.0,
            health_timeout_s=60.0,
            health_failures=3,
        )
    )
    _OWNED.append((gen, [p for p in gen.server_processes if p is not None]))
    yield gen
    _close_owned()


_HERE = Path(__file__).parent
_OWNED: list[tuple[SGLangGenerator, list]] = []


def _close_owned() -> None:
    """Close the session server (idempotent) and check that none of its processes is left."""
    while _OWNED:
        gen, procs = _OWNED.pop()
        asyncio.run(gen.close())
        procs += [p for p in gen.server_processes if p is not None]
        left = {p.pid: p.group_pids() for p in procs}
        assert not any(left.values()), f"SGLang processes left after close: {left}"


_SESSION_MODULES: set[Path] = set()
"""Files with a test on the session server (``owner``, directly or through ``attach``)."""


def _uses_owner(item: pytest.Item) -> bool:
    """Whether ``item`` uses the session server."""
    return "owner" in getattr(item, "fixturenames", ())


def _runs_last(item: pytest.Item) -> bool:
    """Whether ``item``'s module must run after the other session-server modules
    (``SESSION_SERVER_LAST = True``: it kills and restarts the server)."""
    return bool(getattr(getattr(item, "module", None), "SESSION_SERVER_LAST", False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Stop the session server as soon as no later test of this run uses it (the modules on it
    run first): an idle server still costs ~4 GB and its health probes keep a core busy, which
    would slow every later test (and a module's own server would share 2 cores with it)."""
    result = yield
    if _OWNED and (nextitem is None or Path(nextitem.path) not in _SESSION_MODULES):
        _close_owned()
    return result


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE (8 experts, top-2, 2 MoE layers, hidden 64) with the local
    tokenizer, saved with ``save_pretrained`` (safetensors)."""
    save_dir = tmp_path_factory.mktemp("models") / "tiny-moe"
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_hf.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,  # as real Qwen3-MoE checkpoints (see _routing.check_servable)
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(save_dir))
    tok.save_pretrained(str(save_dir))
    return save_dir


def _perturbed(
    weights: dict[str, torch.Tensor], seed: int, scale: float = 0.5
) -> dict[str, torch.Tensor]:
    """Every tensor plus Gaussian noise of ``scale`` times its own std (changes greedy outputs)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        std = float(t.float().std()) if t.numel() > 1 else 1.0
        noise = torch.randn(t.shape, generator=gen) * scale * (std or 1.0)
        out[name] = (t.float() + noise).to(t.dtype)
    return out


class Fingerprints:
    """Teacher-forced log-probs of a fixed token sequence: from a server, and from transformers."""

    PROBE: tuple[int, ...] = (5, 17, 42, 99, 3, 120, 64, 7, 250, 31, 11, 2)
    """Token ids whose teacher-forced log-probs fingerprint the served weights."""

    def served(self, url: str) -> tuple[torch.Tensor, str]:
        """Log-probs of ``PROBE[1:]`` computed by the server at ``url``, and its weight version."""
        body = {
            "input_ids": list(self.PROBE),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        req = urllib.request.Request(
            url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        lps = [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]
        return torch.tensor(lps), str(out["meta_info"]["weight_version"])

    def hf(self, weights: dict[str, torch.Tensor], model_dir: Path) -> torch.Tensor:
        """The same log-probs from transformers with ``weights`` loaded."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        model.load_state_dict(weights, strict=False)
        ids = torch.tensor([list(self.PROBE)])
        with torch.no_grad():
            logp_LV = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        return logp_LV.gather(1, ids[0, 1:, None]).squeeze(1)


@pytest.fixture(scope="session")
def fp() -> Fingerprints:
    """The weight fingerprints (``fp.served(url)``, ``fp.hf(weights, model_dir)``)."""
    return Fingerprints()


@pytest.fixture(scope="session")
def perturbed() -> Callable[..., dict[str, torch.Tensor]]:
    """``perturbed(weights, seed, scale=0.5)``: every tensor plus noise of its own scale."""
    return _perturbed


@pytest.fixture
def attach(owner: SGLangGenerator, tiny_model: Path) -> Iterator[Callable[..., SGLangGenerator]]:
    """``attach(**config)``: a generator attached to the session server, rewound to the base
    weights at version 0; closed (server left running) after the test."""
    made: list[SGLangGenerator] = []

    def make(**kw: object) -> SGLangGenerator:
        gen = SGLangGenerator(
            SGLangGenerator.Config(
                server_urls=tuple(owner.server_urls),
                health_interval_s=0,
                **kw,  # type: ignore[arg-type]
            )
        )
        made.append(gen)
        gen.load_weights_from_disk(str(tiny_model), version=0)
        return gen

    yield make
    for gen in made:
        asyncio.run(gen.close())
