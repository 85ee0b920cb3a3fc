"""In-process reference :class:`~rl_core.interfaces.Generator` on a transformers causal LM.

The rollout engine of the embedded default (one machine, no GPU) and the oracle the real engines
are compared against. Requests from concurrent :meth:`HFGenerator.generate` calls are queued and
served in batches of up to ``max_batch_size`` by one worker thread, so the event loop stays free::

    gen = HFGenerator(HFGenerator.Config(model_path="runs/tiny", max_batch_size=128))
    reqs = [GenerationRequest(request_id=f"r{i}", input_ids=ids, sampling=SamplingParams(seed=i))
            for i, ids in enumerate(prompts)]
    results = await gen.generate(reqs)          # in request order
    await gen.update_weights(update, transport)  # in place, between decode steps

How one batch is generated (names: ``B`` rows, ``L`` prompt length, ``V`` vocab, ``T`` steps):

- prompts are left-padded to ``L``; ``position_ids`` count real tokens only, so a padded row sees
  exactly the positions it would see alone; one prefill of the *distinct* prompts fills a
  ``DynamicCache`` (the samples of a GRPO group share their prompt's prefill), which is then
  expanded to one row per request;
- with ``sdpa`` the 4-D causal/padding masks are built by us and passed in, instead of being
  rebuilt by transformers at every step;
- each decode step feeds one token per row with the grown attention mask and the next position
  (on a Llama-family model, ``Config.fast_decode``: prefill and steps run through
  ``rl_hf._fast_decode``'s lean decoder layer and a static KV cache instead of the transformers
  modules, with the same results);
  rows that finished keep a slot until enough of them finished, then the batch (cache included) is
  compacted to the live rows;
- sampling is vectorised over rows with per-row temperature, top-k, top-p, stop ids and length;
  a request's result is handed back as soon as its row ends, not at the end of the batch.

Weights change only between batches: :meth:`HFGenerator.load_weights` waits for the running
batch (call :meth:`HFGenerator.abort` first to cut it short), so every result was sampled by
exactly one weight version. :meth:`HFGenerator.abort` ends rows at the next decode step with
their partial tokens.

Log-probs (``GenerationResult.output_logprobs``): the log-prob of the sampled token under the
distribution it was drawn from: ``log_softmax(logits / T)`` renormalised over the row's top-k /
top-p candidate set (:func:`rl_core.logprobs.truncate_logits`, the function a policy with the same
``top_p``/``top_k`` applies to its own logits, so on-policy the importance ratio is exactly 1).
Without truncation that is the plain temperature-scaled log-softmax. For greedy rows
(``temperature == 0``) ``T = 1`` is used (and the row's top-k / top-p, if any).

Reproducibility: every row draws its uniforms from its own ``torch.Generator`` seeded with the
request's ``sampling.seed`` (unseeded requests get a seed from ``Config.seed`` in arrival order), and
samples by inverse CDF, so a seeded request gives the same tokens whatever else is in its batch (up
to float round-off of the logits under a different padding).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import random
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch

from rl_core.config import NonNegFloat, NonNegInt, PositiveInt, Range, Seed
from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.interfaces import GenerationChunk, Generator, WeightTransport
from rl_core.lora import AdapterInfo, adapter_of
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    WeightUpdate,
)
from rl_hf._fast_decode import LeanCache, LeanDecoder
from rl_hf._generation import (
    _emit,
    _fail,
    _Pending,
    _post,
    _prefill_routing,
    _resolve,
    _sample_rows,
)

__all__ = ["HFGenerator"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFGenerator(Generator):
    """Batched KV-cache sampling on a Hugging Face causal LM, in this process.

    Build it with :class:`HFGenerator.Config`. It is also a
    :class:`~rl_core.interfaces.WeightTarget`: :meth:`load_weights` copies Hugging Face-named
    tensors into the model in place.
    """

    supports_abort: ClassVar[bool] = True
    """:meth:`abort` ends queued and running requests at the next decode step."""
    supports_pause: ClassVar[bool] = True
    """:meth:`pause` holds queued requests (the running batch finishes) until :meth:`resume`."""
    supports_routing: ClassVar[bool] = True
    """On a mixture-of-experts model, ``return_routing`` gives the router's top-k for every
    token (read from the model's router modules); a dense model asked for it raises
    ``ConfigError``."""
    truncated_logprobs: ClassVar[bool] = True
    """Log-probs are under the top-k / top-p truncated distribution each token was drawn from."""
    streams_tokens: ClassVar[bool] = True
    """:meth:`generate_stream` yields each decode step's token as the step ends."""
    supports_lora_adapters: ClassVar[bool] = True
    """Takes adapter-only updates (:func:`rl_core.lora.adapter_of`): the model is adapted in
    place through peft, several adapters are kept by name; a request's ``adapter`` picks one
    (rows of a batch are generated grouped by adapter), else the last loaded one generates."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`HFGenerator`."""

        model_path: str
        """Directory of a Hugging Face causal LM (``config.json`` and weights)."""
        tokenizer_path: str | None = None
        """Directory of the tokenizer; ``None`` means ``model_path``."""
        dtype: str = "float32"
        """Weights and activations: ``float32``, ``bfloat16`` or ``float16``."""
        device: str = "cpu"
        """Torch device of the model."""
        attn_implementation: str = "sdpa"
        """transformers attention kernel: ``sdpa`` or ``eager``."""
        max_batch_size: PositiveInt = 64
        """Most requests decoded together in one forward."""
        seed: Seed = 0
        """Seeds the per-request seeds of requests that carry none."""
        stop_on_eos: bool = True
        """Treat the tokenizer's (or model config's) EOS and PAD ids as stop tokens."""
        extra_stop_token_ids: tuple[NonNegInt, ...] = ()
        """More stop token ids for every request (on top of each request's own)."""
        compact_fraction: Annotated[float, Range(gt=0, le=1)] = 0.25
        """Compact the batch and its KV cache when this share of its rows finished (1 = never)."""
        initial_version: NonNegInt = 0
        """Weight version reported before the first update."""
        router_logit_noise_std: NonNegFloat = 0.0
        """Gaussian noise of this standard deviation added to every MoE router's logits before
        the top-k (0 = none). It makes the engine's routing differ from the trainer's on purpose
        (a stand-in for a different inference kernel), to measure routing replay; the noise
        draws come from one generator seeded with ``seed``, so results then depend on batching.
        Needs a mixture-of-experts model."""
        fast_decode: bool = True
        """Run prefill and decode steps on a lean reimplementation of the Llama-family decoder
        layer with a static KV cache (``rl_hf._fast_decode``) instead of the transformers
        modules: the same results (bitwise on CPU in the tests), ~1.5x faster decoding on the
        demo model. Used when the model qualifies (``llama``, ``qwen2``, ``qwen3``, ``mistral``
        with full attention) and no LoRA adapter, routing record or forward hook is in play;
        otherwise, or when false, the transformers path runs."""
        threads: NonNegInt = 0
        """torch intra-op threads of the worker thread that generates (0: the process's count).
        With the trainer in the same process (async rollouts), 1 here leaves the other cores to
        the trainer's threads instead of oversubscribing them (``rl-train`` sets half its
        ``threads`` there unless the recipe sets this). Set with ``torch.set_num_threads``
        in the worker, which also makes it the count of threads started after it that do not
        set their own (the trainer's threads do)."""

        def __post_init__(self) -> None:
            if self.dtype not in _DTYPES:
                raise ConfigError(
                    f"HFGenerator.Config.dtype: unknown {self.dtype!r}; use one of {sorted(_DTYPES)}."
                )
            if self.attn_implementation not in ("sdpa", "eager"):
                raise ConfigError(
                    "HFGenerator.Config.attn_implementation: expected 'sdpa' or 'eager', got "
                    f"{self.attn_implementation!r}."
                )
            if self.max_batch_size < 1:
                raise ConfigError(
                    f"HFGenerator.Config.max_batch_size: must be >= 1, got {self.max_batch_size}."
                )
            if self.router_logit_noise_std < 0:
                raise ConfigError(
                    "HFGenerator.Config.router_logit_noise_std: must be >= 0, got "
                    f"{self.router_logit_noise_std}."
                )
            if not 0 < self.compact_fraction <= 1:
                raise ConfigError(
                    "HFGenerator.Config.compact_fraction: must be in (0, 1], got "
                    f"{self.compact_fraction}."
                )

    def __init__(self, config: HFGenerator.Config, *, model: Any = None, tokenizer: Any = None):
        """Load the model (or take ``model``, a ready ``PreTrainedModel``) and its tokenizer.

        ``model`` and ``tokenizer`` are for tests and embedding; normally both come from
        ``config.model_path``.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        path = Path(config.model_path)
        if model is None:
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"HFGenerator.Config.model_path: {path} has no config.json; point it at a "
                    "directory written by save_pretrained (e.g. rl_hf.tiny)."
                )
            from rl_hf._hf import attention_refused, quiet_progress

            try:
                with quiet_progress():
                    model = AutoModelForCausalLM.from_pretrained(
                        path,
                        dtype=_DTYPES[config.dtype],
                        attn_implementation=config.attn_implementation,
                    )
            except ValueError as e:
                what = f"attention {config.attn_implementation!r}"
                error = attention_refused(e, "generator.attn_implementation", what)
                if error is None:
                    raise
                raise error from e
        self.model = model.to(config.device).eval()
        self.model.requires_grad_(False)
        from rl_hf._moe import RouterTap

        self._router_tap = RouterTap.attach(self.model)  # None for a dense model
        if config.router_logit_noise_std > 0:
            if self._router_tap is None:
                raise ConfigError(
                    "HFGenerator.Config.router_logit_noise_std: the model "
                    f"({type(self.model).__name__}) has no mixture-of-experts router to add "
                    "noise to; set it to 0 for a dense model."
                )
            self._router_tap.noise_std = float(config.router_logit_noise_std)
            self._router_tap.noise_generator = torch.Generator(self.model.device).manual_seed(
                config.seed
            )
        if tokenizer is None:
            tok_path = Path(config.tokenizer_path or config.model_path)
            try:
                tokenizer = AutoTokenizer.from_pretrained(tok_path)
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"HFGenerator.Config.tokenizer_path: no tokenizer loads from {tok_path} ({e}); "
                    "save one next to the model or set tokenizer_path."
                ) from e
        self.tokenizer = tokenizer
        """The tokenizer of the served model (Hugging Face)."""

        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        """Rows of the LM head: the ids this generator can sample."""
        stop: list[int] = []
        if config.stop_on_eos:
            for src in (tokenizer, self.model.config):
                for name in ("eos_token_id", "pad_token_id"):
                    v = getattr(src, name, None)
                    stop.extend(v if isinstance(v, list) else [v] if v is not None else [])
        stop.extend(config.extra_stop_token_ids)
        self.default_stop_ids: tuple[int, ...] = tuple(
            sorted({int(s) for s in stop if 0 <= int(s) < self.vocab_size})
        )
        """Stop ids added to every request's own ``stop_token_ids``."""
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None and 0 <= pad < self.vocab_size else 0
        self._state = self.model.state_dict(keep_vars=False)
        from rl_hf._lora import GeneratorAdapters

        self._adapters = GeneratorAdapters(self.model)
        mc = self.model.config
        # transformers 5.x names the KV-cache argument ``cache`` (``past_key_values`` still works
        # but warns, and goes in 5.40); 4.x knows only ``past_key_values``.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # Our own causal masks only where every layer attends causally to the whole sequence: a
        # sliding layer (``layer_types``, or Mistral's ``sliding_window`` on every layer) gets
        # transformers' masks, which agree with its cache trimming to the window.
        layer_types = getattr(mc, "layer_types", None)
        self._own_masks = (
            getattr(mc, "_attn_implementation", None) == "sdpa"
            and all(lt == "full_attention" for lt in (layer_types or ["full_attention"]))
            and (layer_types is not None or getattr(mc, "sliding_window", None) is None)
        )

        self._lean = LeanDecoder.build(self.model) if config.fast_decode else None
        self._version = config.initial_version
        self._seed_rng = random.Random(config.seed)
        # Held for a whole batch by the worker and for the copy by load_weights: weights never
        # change under a running batch, and every result has exactly one version.
        self._weights_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._staged: dict[asyncio.AbstractEventLoop, list[_Pending]] = {}
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        """Streamed requests (:meth:`generate_stream`) by ``id`` of their pending record."""
        self._updates_waiting = 0
        self._abort_all_epoch = 0
        self._abort_ids: set[str] = set()
        self._abort_seq = 0
        self._running_ids: set[str] = set()
        self._closed = False
        self._paused = False
        self._worker: threading.Thread | None = None
        self.last_batch_stats: dict[str, float] = {}
        """Timing of the last batch (``prefill_s``, ``decode_s``, ``steps``, ``rows``)."""

    # ------------------------------------------------------------------ Generator API

    @property
    def weight_version(self) -> int:
        """Version of the weights currently served."""
        return self._version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve ``requests``; results come back in request order.

        Requests of concurrent calls made in the same event-loop tick share batches.
        """
        if not requests:
            if self._closed:
                raise GenerationError(
                    "HFGenerator.generate: the generator is closed; build a new one."
                )
            return []
        pending = self._submit(requests)
        return list(await asyncio.gather(*(p.future for p in pending)))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Serve ``request``, yielding the tokens each decode step samples for it (with their
        log-probs) as the step ends, while the rest of its batch keeps decoding; the last chunk
        carries the result, the one :meth:`generate` gives (the tokens and log-probs streamed
        are the result's). Closing the iterator early stops the stream, not the request (call
        :meth:`abort`)."""
        queue: asyncio.Queue[tuple[tuple[int, ...], tuple[float, ...]] | None] = asyncio.Queue()
        (p,) = self._submit([request], stream=queue)
        p.future.add_done_callback(lambda _: queue.put_nowait(None))
        sent = 0
        try:
            while (item := await queue.get()) is not None:
                sent += len(item[0])
                yield GenerationChunk(item[0], item[1])
            result = p.future.result()
            yield GenerationChunk(result.output_ids[sent:], result.output_logprobs[sent:], result)
        finally:
            self._streams.pop(id(p), None)

    def _submit(
        self,
        requests: Sequence[GenerationRequest],
        stream: asyncio.Queue[Any] | None = None,
    ) -> list[_Pending]:
        """Queue ``requests`` for the worker (batched with the other requests of this
        event-loop tick); with ``stream``, each decode step's token of the (single) request is
        put on that queue."""
        if self._closed:
            raise GenerationError("HFGenerator.generate: the generator is closed; build a new one.")
        loop = asyncio.get_running_loop()
        pending = []
        for req in requests:
            self._check_request(req)
            seed = req.sampling.seed
            if seed is None:
                seed = self._seed_rng.getrandbits(63)
            pending.append(_Pending(req, loop, loop.create_future(), int(seed)))
        if stream is not None:
            self._streams[id(pending[0])] = (loop, stream)
        staged = self._staged.get(loop)
        if staged is None:
            # Flush after the other tasks of this tick have queued theirs: one batch for a gather.
            self._staged[loop] = staged = []
            loop.call_soon(self._flush, loop)
        staged.extend(pending)
        return pending

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """``transport.apply(update, self)`` in a worker thread; waits for the running batch.

        Call :meth:`abort` first to cut a long batch short. On failure the old weights and version
        stay (the transport verifies everything before :meth:`load_weights` touches the model).
        With an adapter-only update (:func:`rl_core.lora.adapter_of`) the tensors go to
        :meth:`load_adapter` under the update's adapter name.
        """
        info = adapter_of(update)
        target: Any = self if info is None else _AdapterTarget(self, info)
        await asyncio.to_thread(transport.apply, update, target)

    @property
    def active_adapter(self) -> str | None:
        """The LoRA adapter generation uses (the one loaded last), or ``None``: the base."""
        return self._adapters.active

    def load_adapter(
        self, info: AdapterInfo, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Load the adapter ``info`` (peft-named tensors, all ``A`` and ``B`` of its targets)
        between batches, make it the active one and set ``version``; the base weights stay.
        Everything is checked before the model changes. A multi-adapter update (``info.names``,
        tensors named ``<adapter>/<peft name>``) loads every adapter it names, and
        ``info.name`` becomes the active one (the adapter of requests that name none).

        Raises:
            WeightSyncError: the adapter does not fit the served model (names, shapes, targets),
                its settings are not plain LoRA, or an adapter of that name had other settings.
        """
        try:
            lora = info.lora
        except ConfigError as e:
            raise WeightSyncError(f"HFGenerator.load_adapter: adapter {info.name!r}: {e}") from e
        tensors = dict(named_tensors)
        with self._cond:
            self._updates_waiting += 1
        try:
            with self._weights_lock, torch.no_grad():
                self._adapters.load_update(info, lora, tensors)
                self._state = self._adapters.base_state()
                self._version = int(version)
        finally:
            with self._cond:
                self._updates_waiting -= 1
                self._cond.notify_all()

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Copy Hugging Face-named tensors into the model in place and set ``version``.

        Names are the model's ``state_dict`` names; a tied ``lm_head.weight`` may be sent or
        omitted; a mixture-of-experts model also takes per-expert checkpoint names
        (``...experts.{e}.gate_proj.weight``, as MegatronPolicy sends them), fused into its
        expert tensors. All names and shapes are checked before any weight changes.
        """
        from rl_hf._moe import fuse_expert_tensors

        try:
            tensors = fuse_expert_tensors(list(named_tensors), self._state)
        except ValueError as e:
            raise WeightSyncError(
                f"HFGenerator.load_weights: {e} The update is for a different architecture."
            ) from e
        for name, t in tensors:
            dst = self._state.get(name)
            if dst is None:
                raise WeightSyncError(
                    f"HFGenerator.load_weights: tensor {name!r} is not in the served model; send "
                    "Hugging Face state_dict names (e.g. 'model.layers.0.mlp.up_proj.weight')."
                )
            if tuple(dst.shape) != tuple(t.shape):
                raise WeightSyncError(
                    f"HFGenerator.load_weights: tensor {name!r} has shape {tuple(t.shape)}, the "
                    f"model has {tuple(dst.shape)}; the update is for a different architecture."
                )
        with self._cond:
            self._updates_waiting += 1
        try:
            with self._weights_lock, torch.no_grad():
                for name, t in tensors:
                    self._state[name].copy_(t)
                self._version = int(version)
        finally:
            with self._cond:
                self._updates_waiting -= 1
                self._cond.notify_all()

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """End the given (or all) queued and running requests with ``FinishReason.ABORT``.

        Running ones stop at the next decode step and keep their partial tokens and log-probs;
        queued ones return empty. Unknown ids are ignored.
        """
        with self._cond:
            if request_ids is None:
                self._abort_all_epoch += 1
                dropped = list(self._queue)
                self._queue.clear()
                for staged in self._staged.values():
                    dropped.extend(staged)
                    staged.clear()
            else:
                ids = set(request_ids)
                self._abort_ids |= ids & self._running_ids
                dropped = [p for p in self._queue if p.request.request_id in ids]
                self._queue = collections.deque(
                    p for p in self._queue if p.request.request_id not in ids
                )
                for staged in self._staged.values():
                    dropped.extend(p for p in staged if p.request.request_id in ids)
                    staged[:] = [p for p in staged if p.request.request_id not in ids]
            self._abort_seq += 1
        for p in dropped:
            res = GenerationResult(
                request_id=p.request.request_id,
                output_ids=(),
                output_logprobs=(),
                finish_reason=FinishReason.ABORT,
                weight_version=self._version,
            )
            _post(p.loop, _resolve, p.future, res)

    async def pause(self) -> None:
        """Start no new batch until :meth:`resume`; the running batch completes."""
        with self._cond:
            self._paused = True

    async def resume(self) -> None:
        """Serve queued requests again after :meth:`pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def health(self) -> bool:
        """True while the generator is open and its worker (if started) is alive."""
        return not self._closed and (self._worker is None or self._worker.is_alive())

    async def close(self) -> None:
        """Abort what is queued or running, stop the worker thread and free the model."""
        if self._closed:
            return
        await self.abort()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.join)
        self.model = self._lean = None
        self._state = {}

    # ------------------------------------------------------------------ queueing

    def _check_request(self, req: GenerationRequest) -> None:
        if req.adapter is not None and req.adapter not in self._adapters.configs:
            raise GenerationError(
                f"HFGenerator.generate: request {req.request_id!r} asks for LoRA adapter "
                f"{req.adapter!r}, which is not loaded (loaded: {sorted(self._adapters.configs)}); "
                "publish it first (an adapter-only weight update) or send adapter=None."
            )
        if req.return_routing and self._router_tap is None:
            raise ConfigError(
                f"rollout.routing_replay: request {req.request_id!r} asks for the routed experts "
                f"but the served model ({type(self.model).__name__}) is not a mixture-of-experts "
                "model; set rollout.routing_replay: off for a dense model."
            )
        if not req.input_ids:
            raise GenerationError(
                f"HFGenerator.generate: request {req.request_id!r} has empty input_ids; send at "
                "least one prompt token."
            )
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and len(req.input_ids) + req.sampling.max_new_tokens > limit:
            raise GenerationError(
                f"HFGenerator.generate: request {req.request_id!r} has {len(req.input_ids)} prompt "
                f"tokens + max_new_tokens={req.sampling.max_new_tokens} > the model's "
                f"max_position_embeddings={limit}; shorten the prompt or lower max_new_tokens."
            )
        lo, hi = min(req.input_ids), max(req.input_ids)
        if lo < 0 or hi >= self.vocab_size:
            raise GenerationError(
                f"HFGenerator.generate: request {req.request_id!r} has token id "
                f"{lo if lo < 0 else hi} outside the vocabulary [0, {self.vocab_size}); was it "
                "tokenized with another tokenizer?"
            )

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._cond:
            staged = self._staged.pop(loop, [])
            self._queue.extend(staged)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name="HFGenerator-worker", daemon=True
                )
                self._worker.start()
            self._cond.notify_all()

    def _work(self) -> None:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        while True:
            with self._cond:
                while not self._closed and (
                    not self._queue or self._updates_waiting or self._paused
                ):
                    self._cond.wait()
                if self._closed:
                    return
                n = min(self.config.max_batch_size, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                self._running_ids = {p.request.request_id for p in batch}
                epoch = self._abort_all_epoch
            try:
                with self._weights_lock:
                    self.last_batch_stats = self._adapters.run_grouped(
                        batch, functools.partial(self._run_batch, epoch=epoch)
                    )
            except BaseException as e:  # the callers get the error, the worker lives on
                err = e if isinstance(e, Exception) else GenerationError(repr(e))
                for p in batch:
                    _post(p.loop, _fail, p.future, err)
            finally:
                with self._cond:
                    self._running_ids = set()
                    self._abort_ids.clear()

    def _aborted_rows(self, ids: list[str], epoch: int) -> list[int] | None:
        """Rows (by index into ``ids``) aborted since the batch started, or None if none."""
        with self._cond:
            if self._abort_all_epoch != epoch or self._closed:
                return list(range(len(ids)))
            if not self._abort_ids:
                return None
            return [i for i, rid in enumerate(ids) if rid in self._abort_ids]

    # ------------------------------------------------------------------ the hot path

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Pending], epoch: int) -> dict[str, float]:
        """Generate one batch; each request's future is resolved as soon as its row ends."""
        from transformers import DynamicCache

        reqs = [p.request for p in batch]
        T = max(r.sampling.max_new_tokens for r in reqs)
        t0 = time.perf_counter()
        ids_BL, mask_BL, pos_BL, lens_B = self._pack_prompts(reqs)
        st = self._row_state(batch, mask_BL, lens_B, T)
        tap = self._router_tap
        record = tap is not None and any(r.return_routing for r in reqs)
        cache: Any = None
        if self._lean is not None and self._adapters.peft is None and not record:
            cache = self._lean.cache(prompt_len=ids_BL.shape[1], steps=T)  # None: not this one
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        with tap.recording() if tap is not None and record else contextlib.nullcontext() as rec:
            logits_AV = self._prefill(reqs, ids_BL, mask_BL, pos_BL, cache)
            if rec is not None and tap is not None:
                # [B, L, layers, K] left-padded like the prompts; step t's row goes to route[:, t]
                st["prompt_route"] = _prefill_routing(
                    reqs, rec.take(), ids_BL.shape[1], tap.shape.dtype
                )
                st["route"] = st["prompt_route"].new_zeros(
                    (len(reqs), T, tap.shape.num_layers, tap.shape.top_k)
                )
            t1 = time.perf_counter()
            steps = self._decode(
                batch, st, cache, logits_AV, prompt_len=ids_BL.shape[1], epoch=epoch, rec=rec
            )
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": steps, "rows": len(reqs)}

    def _pack_prompts(
        self, reqs: list[GenerationRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompts ``(ids [B, L], mask [B, L], positions [B, L], lengths [B])``;
        positions count real tokens only, so a padded row sees the positions it would alone."""
        lens = [len(r.input_ids) for r in reqs]
        B, L = len(reqs), max(lens)
        flat = torch.tensor([i for r in reqs for i in r.input_ids], dtype=torch.long)
        lens_B = torch.tensor(lens, dtype=torch.long)
        mask_BL = torch.arange(L)[None, :] >= (L - lens_B)[:, None]
        ids_BL = torch.full((B, L), self._pad_id, dtype=torch.long)
        ids_BL[mask_BL] = flat
        pos_BL = (mask_BL.long().cumsum(-1) - 1).clamp_(min=0)
        return ids_BL, mask_BL, pos_BL, lens_B

    def _row_state(
        self, batch: list[_Pending], mask_BL: torch.Tensor, lens_B: torch.Tensor, T: int
    ) -> dict[str, torch.Tensor]:
        """Per-row decode state, one entry per row still in the batch ("A" rows); compacting
        the batch selects all of it (and the KV cache) at once."""
        sp = [p.request.sampling for p in batch]
        B = len(batch)
        temp_A = torch.tensor([s.temperature for s in sp], dtype=torch.float32)
        stops = [sorted(set(s.stop_token_ids) | set(self.default_stop_ids)) for s in sp]
        S = max(1, max(len(s) for s in stops))
        stop_AS = torch.full((B, S), -1, dtype=torch.long)
        for b, s in enumerate(stops):
            if s:
                stop_AS[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        # One uniform per row and step from the row's own generator: batch-independent.
        u_AT = torch.empty((B, T), dtype=torch.float64)
        gen = torch.Generator()
        for b, p in enumerate(batch):
            gen.manual_seed(p.seed)
            u_AT[b] = torch.rand(T, generator=gen, dtype=torch.float64)
        return {
            "row": torch.arange(B),
            "greedy": temp_A == 0,
            "scale": torch.where(temp_A == 0, 1.0, temp_A),
            "top_p": torch.tensor([s.top_p for s in sp], dtype=torch.float32),
            "top_k": torch.tensor([max(s.top_k, 0) for s in sp], dtype=torch.long),
            "max_new": torch.tensor([s.max_new_tokens for s in sp], dtype=torch.long),
            "stop": stop_AS,
            "u": u_AT,
            # attention mask of prompt and all future tokens; step t uses its first L + t + 1
            "mask": torch.cat([mask_BL, torch.ones((B, T), dtype=torch.bool)], 1),
            "pos": lens_B.clone(),
            "ids": torch.zeros((B, T), dtype=torch.long),
            "lp": torch.zeros((B, T), dtype=torch.float32),
        }

    def _prefill(
        self,
        reqs: list[GenerationRequest],
        ids_BL: torch.Tensor,
        mask_BL: torch.Tensor,
        pos_BL: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """Prefill each distinct prompt once (a GRPO group shares its prompt), then give every
        row its prompt's KV cache; returns the last-position logits ``[B, V]``."""
        dev = self.model.device
        B, L = ids_BL.shape
        first: dict[tuple[int, ...], int] = {}
        inv = [first.setdefault(r.input_ids, b) for b, r in enumerate(reqs)]
        uniq_U = torch.tensor(sorted(first.values()), dtype=torch.long)
        if len(first) < B:
            row_of = {b: u for u, b in enumerate(uniq_U.tolist())}
            expand_B = torch.tensor([row_of[b] for b in inv], dtype=torch.long)
        else:
            uniq_U = expand_B = None
        pre_ids, pre_mask, pre_pos = (
            (ids_BL, mask_BL, pos_BL)
            if uniq_U is None
            else (ids_BL[uniq_U], mask_BL[uniq_U], pos_BL[uniq_U])
        )
        lean = isinstance(cache, LeanCache)
        if self._own_masks or lean:
            # Causal and padding mask built once here instead of by transformers at every call;
            # padded query rows attend to themselves so no row is fully masked (NaN in SDPA).
            causal_LL = torch.ones(L, L, dtype=torch.bool).tril_()
            eye_LL = torch.eye(L, dtype=torch.bool)
            mask_U1LL = ((causal_LL[None] & pre_mask[:, None, :]) | eye_LL[None])[:, None]
            attn: Any = mask_U1LL.to(dev)
        else:
            attn = pre_mask.long().to(dev)
        if lean:
            logits_AV = cache.prefill(pre_ids.to(dev), attn, pre_pos.to(dev))
        else:
            logits_AV = self.model(
                input_ids=pre_ids.to(dev),
                attention_mask=attn,
                position_ids=pre_pos.to(dev),
                **{self._cache_arg: cache},
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        if expand_B is not None:
            cache.batch_select_indices(expand_B.to(dev))
            logits_AV = logits_AV[expand_B.to(dev)]
        return logits_AV

    def _decode(
        self,
        batch: list[_Pending],
        st: dict[str, torch.Tensor],
        cache: Any,
        logits_AV: torch.Tensor,
        *,
        prompt_len: int,
        epoch: int,
        rec: Any = None,
    ) -> int:
        """Sample until every row stopped, hit its length or was aborted; each row's result is
        posted as soon as it ends. Returns the number of decode steps taken."""
        B, T = st["u"].shape
        ids_ = [p.request.request_id for p in batch]
        version = self._version
        filter_any = bool((st["top_k"] > 0).any()) or bool((st["top_p"] < 1).any())
        any_greedy = bool(st["greedy"].any())
        live_A = torch.ones(B, dtype=torch.bool)
        abort_seq = self._abort_seq
        steps = 0
        # Streamed rows (generate_stream): batch index -> (loop, queue), known before decoding.
        streamed = {b: q for b, p in enumerate(batch) if (q := self._streams.get(id(p)))}
        for t in range(T):
            tok_A, lp_A = _sample_rows(
                logits_AV.float(),
                scale_A=st["scale"],
                greedy_A=st["greedy"] if any_greedy else None,
                top_p_A=st["top_p"],
                top_k_A=st["top_k"],
                u_A=st["u"][:, t],
                filter_any=filter_any,
            )
            tok_A = tok_A.cpu()
            steps += 1
            st["ids"][:, t] = tok_A
            st["lp"][:, t] = lp_A.cpu()
            if streamed:
                _stream_step(streamed, st["row"], live_A, tok_A, st["lp"][:, t])
            stop_A = (tok_A[:, None] == st["stop"]).any(-1)
            ended_A = live_A & (stop_A | (st["max_new"] <= t + 1))
            live_A &= ~ended_A
            hit_A = None
            if self._abort_seq != abort_seq:
                abort_seq = self._abort_seq
                hit_A = self._aborted_live_rows(ids_, epoch, st["row"], live_A)
                if hit_A is not None:
                    live_A &= ~hit_A
                    ended_A |= hit_A
            if bool(ended_A.any()):
                rows = ended_A.nonzero().squeeze(-1).tolist()
                _emit(batch, st, rows, t + 1, stop_A, hit_A, version, prompt_len)
            n_live = int(live_A.sum())
            if n_live == 0:
                break
            A = live_A.shape[0]
            if A - n_live >= max(1, self.config.compact_fraction * A):
                keep_A = live_A.nonzero().squeeze(-1)
                cache.batch_select_indices(keep_A.to(self.model.device))
                st = {k: v[keep_A] for k, v in st.items()}
                tok_A, live_A = tok_A[keep_A], live_A[keep_A]
                any_greedy = bool(st["greedy"].any())
            logits_AV = self._decode_step(tok_A, st, cache, prompt_len + t + 1)
            if rec is not None:
                st["route"][:, t] = rec.take().to("cpu", st["route"].dtype)
            st["pos"] += 1
        return steps

    def _aborted_live_rows(
        self, ids: list[str], epoch: int, row_A: torch.Tensor, live_A: torch.Tensor
    ) -> torch.Tensor | None:
        """Live rows (mask over the rows still in the batch) aborted since the batch started,
        or None when no request of this batch was aborted."""
        hit = self._aborted_rows(ids, epoch)
        if not hit:
            return None
        hit_B = torch.zeros(len(ids), dtype=torch.bool)
        hit_B[hit] = True
        return hit_B[row_A] & live_A

    def _decode_step(
        self, tok_A: torch.Tensor, st: dict[str, torch.Tensor], cache: Any, seen: int
    ) -> torch.Tensor:
        """Feed one token per row (attending to the first ``seen`` mask columns); returns the
        next logits ``[A, V]``."""
        dev = self.model.device
        mask_now_AK = st["mask"][:, :seen].to(dev)
        if isinstance(cache, LeanCache):
            return cache.step(tok_A.to(dev), mask_now_AK, st["pos"].to(dev))
        attn = mask_now_AK[:, None, None, :] if self._own_masks else mask_now_AK.long()
        return self.model(
            input_ids=tok_A[:, None].to(dev),
            attention_mask=attn,
            position_ids=st["pos"][:, None].to(dev),
            **{self._cache_arg: cache},
            use_cache=True,
        ).logits[:, -1]


def _stream_step(
    streamed: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]],
    row_A: torch.Tensor,
    live_A: torch.Tensor,
    tok_A: torch.Tensor,
    lp_A: torch.Tensor,
) -> None:
    """Hand this step's token and log-prob of every streamed row that was live to its
    caller's event loop (one wake-up per loop); posted before the step's ended rows are
    emitted, so a stream's tokens arrive before its result."""
    out: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
    rows, live, toks, lps = row_A.tolist(), live_A.tolist(), tok_A.tolist(), lp_A.tolist()
    for a, b in enumerate(rows):
        if live[a] and b in streamed:
            loop, queue = streamed[b]
            out.setdefault(loop, []).append((queue, ((toks[a],), (lps[a],))))
    for loop, items in out.items():
        _post(loop, _put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class _AdapterTarget:
    """The :class:`~rl_core.interfaces.WeightTarget` a transport applies an adapter-only update
    to: :meth:`HFGenerator.load_adapter` under the update's adapter."""

    def __init__(self, generator: HFGenerator, info: AdapterInfo) -> None:
        self.generator, self.info = generator, info

    @property
    def weight_version(self) -> int:
        """The generator's version."""
        return self.generator.weight_version

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Load the adapter tensors (peft names)."""
        self.generator.load_adapter(self.info, named_tensors, version=version)
