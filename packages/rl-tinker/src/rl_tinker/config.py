"""Typed settings of the service (``rl-tinker serve CONFIG``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from rl_core.config import Range

__all__ = ["ServiceConfig"]


@dataclass(kw_only=True, slots=True)
class ServiceConfig:
    """Settings of :class:`~rl_tinker.server.TinkerService`.

    Example (YAML)::

        models: {tiny: /path/to/tiny-model, smollm2: ~/.cache/rl-models/smollm2-135m-instruct}
        state_dir: runs/tinker
        port: 8765
    """

    models: dict[str, str]
    """Base models clients may name (``base_model``), each a local Hugging Face directory."""
    state_dir: str
    """Where checkpoints (``tinker://`` paths) live; a new service on the same directory finds
    every checkpoint the last one saved."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: Annotated[int, Range(ge=0, le=65535)] = 8765
    """TCP port (0: any free port)."""
    device: str = "cpu"
    """Torch device of the base models and adapters."""
    api_key: str = ""
    """When set, requests must carry it (``X-API-Key``; the SDK sends ``TINKER_API_KEY``)."""
    max_models_per_session: Annotated[int, Range(ge=1)] = 8
    """Training clients (adapters) one session may create; more is answered 400."""
    max_models: Annotated[int, Range(ge=1)] = 64
    """Training clients the whole service holds; more is answered 400."""
    max_queued_per_model: Annotated[int, Range(ge=1)] = 64
    """Operations a training client may have submitted and not finished; more is answered 400."""
    sampler: Literal["hf", "policy", "sglang"] = "hf"
    """What serves ``sample``: ``hf``, rl-hf's ``HFGenerator`` in process (batched KV-cache
    decoding on a module tree that shares the base model's weights; each sampler snapshot a
    named LoRA adapter of it, loaded adapter-only and picked per request); ``policy``, the
    service's own token-by-token loop on the training peft model (no generator); ``sglang``,
    rl-sglang's ``SGLangGenerator`` (servers launched with LoRA serving, each snapshot a
    LoRA adapter written under ``state_dir/sglang-adapters`` and loaded by name; ``sglang``
    sets its options). Prompt log-probs (``compute_logprobs``) are a forward of the training
    model in every case."""
    sglang: dict[str, Any] = field(default_factory=dict)
    """With ``sampler: sglang``: ``SGLangGenerator.Config`` fields (``python``, ``server_urls``,
    ``max_lora_rank`` (default 64), ``lora_target_modules`` (default the attention and MLP
    projections; tenants must not train the LM head then: ``train_unembed=False``),
    ``server_args``, ...); ``model_path`` is the base model's directory."""
    max_sampler_slots: Annotated[int, Range(ge=1)] = 4
    """Sampler snapshots kept loaded per base model (least recently used dropped; with
    ``sampler: hf`` per LoRA shape, the slot then reused by the next snapshot)."""
    max_sample_tokens: Annotated[int, Range(ge=1)] = 4096
    """Cap on ``max_tokens`` of a sample request."""
    future_poll_s: Annotated[float, Range(gt=0, le=40)] = 20.0
    """How long ``retrieve_future`` holds a poll for a result before answering try-again."""
    batch_tenants: bool = False
    """Run queued ``forward`` / ``forward_backward`` operations of different tenants on one base
    as one multi-LoRA batch (each row through its own adapter, one backward): faster with many
    tenants; each tenant's results then equal its solo results within float rounding, not
    bitwise (off: every operation alone, bitwise reproducible whatever the other tenants do)."""
    max_batch_tenants: Annotated[int, Range(ge=2)] = 8
    """Most tenants in one batch with ``batch_tenants``."""
    tags: list[str] = field(default_factory=list)
    """Free labels (reported in ``/metrics``)."""
