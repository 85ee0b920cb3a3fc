"""SGLangGenerator: a :class:`~rl_core.interfaces.Generator` backed by real SGLang servers.

It launches ``num_servers`` SGLang servers (each its own process group, from the interpreter of
SGLang's own venv) or attaches to running ones, optionally behind the SGLang router, and serves
requests token-in/token-out::

    gen = SGLangGenerator(SGLangGenerator.Config(model_path="runs/tiny", num_servers=2))
    results = await gen.generate(requests)             # token ids, log-probs, finish, version
    await gen.update_weights(update, transport)        # disk_full / disk_delta / any transport
    await gen.close()                                  # stops servers and router

Protocol (SGLang 0.5.23, verified on CPU): ``/generate`` with ``input_ids`` and
``return_logprob``; the server runs with ``--skip-tokenizer-init``, so no text is ever decoded or
re-encoded. Weight updates go to every server directly (the router does not route control
endpoints): ``/update_weights_from_disk`` for a verified checkpoint directory (the
:class:`~rl_weightsync.disk_full.DiskWeightTarget` protocol: ``disk_full`` versions, and the local
checkpoint ``disk_delta`` patches), ``/begin_weight_update`` + ``/update_weights_from_tensor`` +
``/end_weight_update`` for tensors of any other transport (a plain pickle payload: the default
ForkingPickler payload crashes a CPU server), and ``/update_weights_from_distributed`` over a
collective group for :class:`~rl_sglang.collective.SGLangCollectiveTransport`. Every update stamps
the server's weight version; every response's version is checked against the generator's.

Failure handling: requests that fail on a connection error, a 5xx, a server that is marked down
or a server on the wrong weight version are retried (with exponential backoff) on the other
servers; after ``max_retries`` retries the request returns ``ERROR`` with no tokens (its rollout
is failed: counted by the trainer, never trained on) and is counted in
``stats["failed_requests"]``. A health monitor probes
``/health_generate`` every ``health_interval_s`` (not while paused or updating); a server whose
process died, or that failed ``health_failures`` probes in a row, is taken out of rotation,
restarted on the same port (owned servers), re-synced to the current weights and version, and
put back.

Log-probs under top-p / top-k: SGLang's sampler returns ``log_softmax(logits / T)`` of the
sampled token *before* truncation (its ``SGLANG_RETURN_ORIGINAL_LOGPROB`` env switches only to the
pre-temperature values; 0.5.x has no option for the renormalised, post-top-p values), so
``truncated_logprobs`` stays false: under truncated sampling these sit ``log S`` (the kept mass)
below the trainer's top-p-aware log-probs, and rl-train refuses a mismatch correction against them
(:mod:`rl_trainer.step.truncation`).

Seeds: SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``, which
needs a GPU attention backend; on CPU, seeded requests are sent with their seed but sampling is
not reproducible.

Layout: this module holds the config and composes the generator from the parts it owns, each an
object with its own state: the :class:`~rl_sglang._fleet.ServerFleet` (launch or attach, router,
pause, health, restart; ``_fleet``), the :class:`~rl_sglang._requests.RequestDispatcher`
(requests, retries, aborts; ``_requests``), the :class:`~rl_sglang._weights.WeightUpdater` (the
weight version and every update; ``_weights``) and the :class:`~rl_sglang._lora.LoRARegistry`
(adapters; ``_lora``), over one :class:`~rl_sglang._http.ServerClient` and the private IO loop
(``_io``); the launch options are in ``_launch``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch

from rl_core.config import (
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Range,
    Seed,
    check_ranges,
)
from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.lora import adapter_of
from rl_core.types import GenerationRequest, GenerationResult, WeightUpdate
from rl_sglang._fleet import PAUSE_MODES, ServerFleet
from rl_sglang._http import ServerClient
from rl_sglang._io import IOLoop
from rl_sglang._launch import (
    TYPED_SERVER_ARGS,
    ServerLauncher,
    check_gpu_budget,
    typed_server_args,
    visible_gpus,
)
from rl_sglang._lora import LoRARegistry
from rl_sglang._requests import RequestDispatcher
from rl_sglang._routing import RoutingLayout, check_servable
from rl_sglang._weights import TENSOR_PUSH_MODES, WeightUpdater, memory_tags
from rl_sglang.server import ManagedProcess, ServerArgs

__all__ = ["PAUSE_MODES", "SGLangGenerator"]

log = logging.getLogger(__name__)


class SGLangGenerator(Generator):
    """Rollout on SGLang servers (launched or attached), optionally behind the SGLang router."""

    supports_abort: ClassVar[bool] = True
    """:meth:`abort` ends requests with their partial tokens and log-probs."""
    supports_pause: ClassVar[bool] = True
    """:meth:`pause` holds new requests server-side (in-flight ones per ``pause_mode``)."""
    supports_memory_release: ClassVar[bool] = True
    """SGLang frees weights and KV cache for a colocated trainer (``release_memory_occupation``);
    an instance says ``False`` unless its servers run on CUDA with ``enable_memory_saver`` (the
    call kills a CPU server)."""
    supports_routing: ClassVar[bool] = True
    """SGLang records mixture-of-experts routing (``return_routed_experts``); an instance says
    ``False`` unless it serves a MoE model with capture on (``Config.capture_routing``)."""
    supports_lora_adapters: ClassVar[bool] = True
    """Adapter-only weight updates load as SGLang LoRA adapters; an instance says ``False``
    unless its servers run with ``enable_lora`` (then the trainer publishes merged weights)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`SGLangGenerator`."""

        model_path: str = ""
        """Hugging Face checkpoint the launched servers serve (also read for EOS and vocab)."""
        server_urls: tuple[str, ...] = ()
        """Attach to these running servers instead of launching (not owned: never stopped)."""
        num_servers: PositiveInt = 1
        """Servers to launch when ``server_urls`` is empty."""
        external_urls: tuple[str, ...] = ()
        """Running servers (external engines) to serve alongside the ``num_servers`` launched
        ones, behind the same router and given the same weight updates (not owned: never
        stopped or restarted, only waited for). They must serve ``model_path``'s model. Use
        ``server_urls`` instead to attach without launching."""
        python: str | None = None
        """Interpreter with SGLang; ``None``: the venv of ``scripts/setup_sglang_env.sh``."""
        device: str = "cpu"
        """``cpu`` (stub driver, torch-native attention) or ``cuda``."""
        server_args: dict[str, Any] = field(default_factory=dict)
        """More SGLang ``ServerArgs`` fields (``max_total_tokens``, ``mem_fraction_static``, ...),
        validated against SGLang's own parser."""
        host: str = "127.0.0.1"
        """Address launched servers and the router bind to."""
        log_dir: str | None = None
        """Server and router logs (and their working directory); ``None``: a temporary dir."""
        startup_timeout_s: PositiveFloat = 600.0
        """Longest wait for a launched server to answer ``/health_generate``."""
        use_router: bool = False
        """Launch the SGLang router in front of the servers for ``/generate`` traffic."""
        router_url: str | None = None
        """Send ``/generate`` through this running router instead (not owned)."""
        router_policy: str = "round_robin"
        """Policy of a launched router."""
        max_concurrency: PositiveInt = 64
        """Requests in flight per server."""
        request_timeout_s: PositiveFloat = 600.0
        """Longest a single ``/generate`` call may take before it is retried."""
        max_retries: NonNegInt = 3
        """Retries of a failing request before it returns ABORT with no tokens."""
        retry_backoff_s: NonNegFloat = 0.5
        """First retry delay; doubles each retry."""
        health_interval_s: NonNegFloat = 5.0
        """Seconds between health probes; 0 disables the monitor."""
        health_timeout_s: PositiveFloat = 60.0
        """A probe slower than this counts as a failure (hung server)."""
        health_failures: PositiveInt = 3
        """Consecutive failed probes that take a server out of rotation."""
        restart_dead_servers: bool = True
        """Restart launched servers that died or hung (attached ones are waited for)."""
        pause_mode: str = "retract"
        """Default mode of :meth:`pause`: ``abort``, ``retract`` or ``in_place``."""
        stop_on_eos: bool = True
        """Stop on the model's EOS and PAD ids (sent as ``stop_token_ids`` with every request).
        ``False`` sends SGLang's ``ignore_eos``, which makes SGLang ignore *every* stop id, so
        responses end only at ``max_new_tokens``; requests (or ``extra_stop_token_ids``) with
        stop ids are then refused rather than silently run past their stops."""
        extra_stop_token_ids: tuple[NonNegInt, ...] = ()
        """More stop ids for every request."""
        seed: Seed = 0
        """Seeds the seeds of requests that carry none."""
        initial_version: NonNegInt = 0
        """Weight version of the starting weights (stamped on the servers)."""
        capture_routing: bool = False
        """Launch the servers with ``--enable-return-routed-experts`` so requests with
        ``return_routing`` get the experts a mixture-of-experts model chose for every token
        (``GenerationResult.routed_experts``); ``model_path`` must be a MoE checkpoint."""
        tp_size: PositiveInt = 1
        """GPUs per launched server, tensor parallel (``--tp-size``; CUDA only)."""
        dp_size: PositiveInt = 1
        """Data-parallel replicas inside one launched server, each on ``tp_size`` GPUs, behind
        SGLang's own DP controller (``--dp-size``; CUDA only)."""
        base_gpu_id: NonNegInt = 0
        """First GPU of this node the launched servers use; server ``i`` takes the
        ``tp_size * dp_size`` GPUs from ``base_gpu_id + i * tp_size * dp_size`` (CUDA only)."""
        mem_fraction_static: Annotated[float, Range(gt=0, lt=1)] | None = None
        """Fraction of device memory for weights and KV cache (``--mem-fraction-static``);
        ``None``: SGLang's default. Lower it when a colocated trainer shares the GPUs."""
        disable_cuda_graph: bool = False
        """Run decode and prefill without CUDA graphs (CUDA only)."""
        cuda_graph_max_bs: PositiveInt | None = None
        """Largest decode batch captured as a CUDA graph (``--cuda-graph-max-bs-decode``;
        CUDA only); ``None``: SGLang's default."""
        enable_lora: bool = False
        """Launch with SGLang's multi-LoRA serving: adapters are loaded by name
        (:meth:`load_lora_adapter`) and picked per request; needs ``max_lora_rank`` and
        ``lora_target_modules``."""
        max_lora_rank: PositiveInt | None = None
        """Largest adapter rank the servers accept (``--max-lora-rank``)."""
        lora_target_modules: tuple[str, ...] = ()
        """Modules adapters may target (``--lora-target-modules``: ``q_proj``, ``v_proj``, ...,
        or ``all``)."""
        max_loras_per_batch: PositiveInt | None = None
        """Adapters one running batch may mix, the base model counted (SGLang default 8)."""
        enable_memory_saver: bool = False
        """Launch with ``--enable-memory-saver`` so :meth:`release_memory` /
        :meth:`resume_memory` can free the GPU for a colocated trainer (CUDA only)."""
        tensor_push: str = "auto"
        """How :meth:`load_weights` (the ``inprocess`` transport's path) sends tensors: ``file``
        writes one safetensors file in a private ``/dev/shm`` directory that the servers load
        (about a second for SmolLM2-135M; the servers must see this host's filesystem),
        ``inline`` pickles them into the HTTP body (works across hosts, ~25x slower), ``auto``:
        ``file`` when every server URL is a loopback address, else ``inline``."""

        def __post_init__(self) -> None:
            if not self.server_urls and not self.model_path:
                raise ConfigError(
                    "SGLangGenerator.Config: set model_path (to launch servers) or server_urls "
                    "(to attach to running ones)."
                )
            if self.num_servers < 1 or self.max_concurrency < 1:
                raise ConfigError(
                    "SGLangGenerator.Config.num_servers and max_concurrency: must be >= 1 (got "
                    f"{self.num_servers}, {self.max_concurrency})."
                )
            if self.pause_mode not in PAUSE_MODES:
                raise ConfigError(
                    f"SGLangGenerator.Config.pause_mode: {self.pause_mode!r} is not one of "
                    f"{PAUSE_MODES}."
                )
            if self.tensor_push not in TENSOR_PUSH_MODES:
                raise ConfigError(
                    f"SGLangGenerator.Config.tensor_push: {self.tensor_push!r} is not one of "
                    f"{TENSOR_PUSH_MODES}."
                )
            if self.device not in ("cpu", "cuda"):
                raise ConfigError(
                    f"SGLangGenerator.Config.device: {self.device!r}; use 'cpu' or 'cuda'."
                )
            if self.max_retries < 0 or self.health_failures < 1:
                raise ConfigError(
                    "SGLangGenerator.Config.max_retries must be >= 0 and health_failures >= 1."
                )
            if self.use_router and self.router_url:
                raise ConfigError(
                    "SGLangGenerator.Config: use_router launches a router; router_url attaches "
                    "to one. Set only one."
                )
            if self.server_urls and self.external_urls:
                raise ConfigError(
                    "SGLangGenerator.Config.external_urls: registers running servers next to "
                    "launched ones, but server_urls attaches without launching; put every URL "
                    "in server_urls (attach only) or drop server_urls (launch num_servers)."
                )
            check_ranges(self, "SGLangGenerator.Config")
            self._check_launch_options()
            self.server_urls = tuple(u.rstrip("/") for u in self.server_urls)
            self.external_urls = tuple(u.rstrip("/") for u in self.external_urls)
            self.extra_stop_token_ids = tuple(int(x) for x in self.extra_stop_token_ids)
            self.server_args = dict(self.server_args)

        def _check_launch_options(self) -> None:
            where = "SGLangGenerator.Config"
            for key in self.server_args:
                field_name = TYPED_SERVER_ARGS.get(str(key).replace("-", "_"))
                if field_name is not None:
                    raise ConfigError(
                        f"{where}.server_args.{key}: set by the typed field {where}.{field_name}; "
                        f"use {field_name} instead."
                    )
            if self.device == "cpu":
                cuda_only = {
                    "tp_size": self.tp_size > 1,
                    "dp_size": self.dp_size > 1,
                    "base_gpu_id": self.base_gpu_id > 0,
                    "disable_cuda_graph": self.disable_cuda_graph,
                    "cuda_graph_max_bs": self.cuda_graph_max_bs is not None,
                    "enable_memory_saver": self.enable_memory_saver,
                }
                bad = [k for k, v in cuda_only.items() if v]
                if bad:
                    raise ConfigError(
                        f"{where}.{bad[0]}: a CUDA option, but device='cpu' (the CPU engine "
                        "runs one process per server, without CUDA graphs or memory saver; "
                        f"set device='cuda' or drop {', '.join(bad)}; use num_servers for "
                        "more CPU servers)."
                    )
            lora_set = {
                "max_lora_rank": self.max_lora_rank is not None,
                "lora_target_modules": bool(self.lora_target_modules),
                "max_loras_per_batch": self.max_loras_per_batch is not None,
            }
            if self.enable_lora and not (
                lora_set["max_lora_rank"] and lora_set["lora_target_modules"]
            ):
                raise ConfigError(
                    f"{where}.enable_lora: needs max_lora_rank and lora_target_modules (SGLang "
                    "sizes its adapter memory from them), e.g. max_lora_rank=16, "
                    "lora_target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']."
                )
            stray = [k for k, v in lora_set.items() if v and not self.enable_lora]
            if stray:
                raise ConfigError(
                    f"{where}.{stray[0]}: a LoRA option, but enable_lora is false; set "
                    "enable_lora=true or drop it."
                )
            if self.disable_cuda_graph and self.cuda_graph_max_bs is not None:
                raise ConfigError(
                    f"{where}.cuda_graph_max_bs: sizes CUDA graphs, but disable_cuda_graph is "
                    "true; set only one."
                )
            if self.server_urls and (self.tp_size > 1 or self.dp_size > 1 or self.base_gpu_id):
                raise ConfigError(
                    f"{where}.tp_size/dp_size/base_gpu_id: launch options, but server_urls "
                    "attaches to running servers; set them where those servers are launched "
                    "(rl_sglang.server_argv) or drop server_urls."
                )

    def __init__(self, config: SGLangGenerator.Config) -> None:
        """Launch (or attach to) the servers and wait until all are healthy."""
        from rl_sglang import _cpu_support

        self.config = c = config
        self.owned = not c.server_urls
        """True when this generator launched its servers (and stops them on close)."""
        self.python = str(c.python or _cpu_support.default_python())
        """Interpreter the servers and the router run in."""
        if (self.owned or c.use_router) and not Path(self.python).exists():
            raise ConfigError(
                f"SGLangGenerator.Config.python: {self.python} does not exist; run "
                "packages/rl-sglang/scripts/setup_sglang_env.sh (installs SGLang into its own "
                "venv) or point `python` at an interpreter with sglang."
            )
        if self.owned:
            check_gpu_budget(c, visible_gpus())
        self._tmp = None
        if c.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rl-sglang-")
            self.log_dir = Path(self._tmp.name)
            """Directory of the server and router logs."""
        else:
            self.log_dir = Path(c.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.routing_layout: RoutingLayout | None = None
        """Where the served model's MoE layers are (``None``: a dense model)."""
        if self.owned:
            check_servable(Path(c.model_path))
            self.routing_layout = RoutingLayout.from_model_dir(Path(c.model_path))
            if c.capture_routing and self.routing_layout is None:
                raise ConfigError(
                    f"SGLangGenerator.Config.capture_routing: {c.model_path}/config.json is not "
                    "a mixture-of-experts model (no num_experts / num_experts_per_tok); turn "
                    "capture_routing off or serve a MoE checkpoint."
                )
        args = {**c.server_args, **typed_server_args(c, 0)}
        args.pop("base_gpu_id", None)  # per server: see _launch
        self.server_args = ServerArgs.validate(args, python=self.python) if self.owned else {}
        """The validated SGLang server arguments (launched servers only)."""
        self.stats: dict[str, int] = {
            "requests": 0,
            "retries": 0,
            "failed_requests": 0,
            "restarts": 0,
            "version_mismatches": 0,
        }
        """Counters: requests served, retries, requests given up, server restarts, responses
        on a wrong weight version."""
        self._io = IOLoop("SGLangGenerator-io", max_connections=0)
        self._procs: list[ManagedProcess] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, self._io)
        client = ServerClient(self._io)
        launcher = ServerLauncher(
            c, python=self.python, server_args=self.server_args, log_dir=self.log_dir
        )
        self._fleet = fleet = ServerFleet(
            io=self._io,
            client=client,
            launcher=launcher,
            procs=self._procs,
            stats=self.stats,
            max_concurrency=c.max_concurrency,
            startup_timeout_s=c.startup_timeout_s,
            health_interval_s=c.health_interval_s,
            health_timeout_s=c.health_timeout_s,
            health_failures=c.health_failures,
            restart_dead_servers=c.restart_dead_servers,
            router_url=c.router_url,
        )
        try:
            fleet.start(
                launch=c.num_servers if self.owned else 0,
                external_urls=c.external_urls,
                attach_urls=c.server_urls,
                use_router=c.use_router,
                version=c.initial_version,
            )
        except BaseException:
            self._finalizer()
            raise
        info = fleet.server_info
        model_dir = self._model_dir()
        if self.routing_layout is None:
            self.routing_layout = RoutingLayout.from_model_dir(model_dir)
        captures = bool(info.get("enable_return_routed_experts"))
        self.supports_routing = captures and self.routing_layout is not None  # type: ignore[misc]
        self.supports_lora: bool = bool(info.get("enable_lora"))
        """The servers serve LoRA adapters (launched with ``enable_lora``)."""
        self.supports_lora_adapters = self.supports_lora  # type: ignore[misc]
        self.supports_memory_release = (  # type: ignore[misc]
            bool(info.get("enable_memory_saver")) and str(info.get("device")) != "cpu"
        )
        self.vocab_size: int | None = _vocab_size(model_dir)
        """Rows of the served model's LM head (``None`` if the checkpoint is not readable)."""
        eos = _eos_ids(model_dir) if c.stop_on_eos else ()
        self.default_stop_ids: tuple[int, ...] = tuple(sorted({*eos, *c.extra_stop_token_ids}))
        """Stop ids sent with every request (EOS and PAD, plus ``extra_stop_token_ids``)."""
        self._weights = WeightUpdater(
            io=self._io,
            client=client,
            fleet=fleet,
            version=c.initial_version,
            base_model=c.model_path or str(info.get("model_path")),
            tensor_push=c.tensor_push,
        )
        self._lora = LoRARegistry(
            io=self._io,
            client=client,
            fleet=fleet,
            weights=self._weights,
            adapters_dir=self.log_dir / "adapters",
            enabled=self.supports_lora,
            max_rank=info.get("max_lora_rank") or c.max_lora_rank,
            target_modules=info.get("lora_target_modules") or c.lora_target_modules,
        )
        self._requests = RequestDispatcher(
            io=self._io,
            client=client,
            fleet=fleet,
            weights=self._weights,
            stats=self.stats,
            seed=c.seed,
            max_retries=c.max_retries,
            retry_backoff_s=c.retry_backoff_s,
            request_timeout_s=c.request_timeout_s,
            stop_on_eos=c.stop_on_eos,
            extra_stop_token_ids=c.extra_stop_token_ids,
            default_stop_ids=self.default_stop_ids,
            vocab_size=self.vocab_size,
            routing_layout=self.routing_layout,
            supports_routing=self.supports_routing,
        )
        fleet.set_hooks(rejoin=self._rejoin, busy=lambda: self._weights.updating)
        self._monitor: Any = None
        if c.health_interval_s > 0:
            self._monitor = self._io.submit(fleet.health_loop())

    def _model_dir(self) -> Path | None:
        path = self.config.model_path or self._fleet.server_info.get("model_path")
        return Path(path) if path and Path(path).is_dir() else None

    async def _rejoin(self, s: Any) -> None:
        """Bring a recovered server to the current weights and adapters and put it back."""
        async with self._weights.lock():
            await self._weights.resync(s)
            await self._lora.reload(s)
            await self._fleet.readmit(s)

    # ------------------------------------------------------------------ properties

    @property
    def weight_version(self) -> int:
        """Version of the weights the servers serve."""
        return self._weights.version

    @property
    def server_urls(self) -> list[str]:
        """URLs of the servers (launched or attached), in index order."""
        return [s.url for s in self._fleet.servers]

    @property
    def server_processes(self) -> list[ManagedProcess | None]:
        """The launcher process of each server (``None`` for attached ones)."""
        return [s.proc for s in self._fleet.servers]

    @property
    def router_url(self) -> str | None:
        """URL ``/generate`` traffic goes to when a router is used."""
        return self._fleet.router_url

    def servers_up(self) -> list[bool]:
        """Whether each server is in rotation."""
        return [s.up for s in self._fleet.servers]

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        lora_adapter: str | Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Serve ``requests`` (concurrently, bounded per server); results in request order.

        ``lora_adapter``: the loaded LoRA adapter to run every request with, or one name (or
        ``None`` for the base model) per request; ``None``: each request's own ``adapter``
        (multi-LoRA), else ``default_lora_adapter``. An adapter name given by a weight update
        resolves to its current version (``task`` -> ``task-v7``).
        """
        if self._fleet.closed:
            raise GenerationError("SGLangGenerator.generate: the generator is closed.")
        if not requests:
            return []
        adapters = self._lora.adapters_for(requests, lora_adapter)
        return await self._requests.generate(requests, adapters)

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given (or all) requests; they return ABORT with their partial tokens.

        Requests still waiting for a slot return ABORT with no tokens. Unknown ids are ignored.
        Aborting all also covers requests of :meth:`generate` calls already made but not yet
        dispatched.
        """
        await self._requests.abort(request_ids)

    async def pause(self, mode: str | None = None) -> None:
        """Hold new requests on every server until :meth:`resume`.

        ``mode`` (default ``Config.pause_mode``): ``abort`` ends in-flight requests (ABORT with
        partial tokens), ``retract`` puts them back in the queue, ``in_place`` freezes them with
        their KV cache. New requests wait server-side either way.
        """
        await self._fleet.pause(mode or self.config.pause_mode)

    async def resume(self) -> None:
        """Continue generation on every server."""
        await self._fleet.resume()

    @property
    def paused(self) -> str | None:
        """The pause mode in effect, or ``None``."""
        return self._fleet.paused

    async def health(self) -> bool:
        """True when at least one server is in rotation and answers ``/health_generate``."""
        return await self._fleet.health()

    # ------------------------------------------------------------------ weights

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Load ``update`` through ``transport`` on every server; on failure keep the old ones.

        An adapter-only update (:func:`rl_core.lora.adapter_of`) is loaded as a LoRA adapter
        (:mod:`rl_sglang._lora`; the servers must run with ``enable_lora``, else
        :class:`~rl_core.errors.ConfigError`). A collective transport (:class:`~rl_sglang.collective.SGLangCollectiveTransport`)
        broadcasts into the servers; disk transports hand the verified checkpoint directory to
        ``/update_weights_from_disk``; any other transport's tensors are pushed with
        ``/update_weights_from_tensor``.
        """
        from rl_sglang.collective import SGLangCollectiveTransport

        if self._fleet.closed:
            raise GenerationError("SGLangGenerator.update_weights: the generator is closed.")
        if adapter_of(update) is not None:
            if isinstance(transport, SGLangCollectiveTransport):
                raise WeightSyncError(
                    "SGLangGenerator.update_weights: adapter-only updates do not go through "
                    "sglang_collective (it writes model weights into the servers); send them "
                    "with disk_full, disk_delta, broadcast or inprocess."
                )
            await self._lora.update(update, transport)
            return
        if isinstance(transport, SGLangCollectiveTransport):
            await self._io.run(self._weights.distributed_update(update, transport))
            return
        await asyncio.to_thread(transport.apply, update, self)

    def load_weights_from_disk(self, path: str, *, version: int) -> None:
        """Point every server at the Hugging Face checkpoint ``path`` and set ``version``.

        Called by disk transports after they verified the checkpoint (``DiskWeightTarget``).

        Raises:
            WeightSyncError: the checkpoint holds transformers' fused MoE expert tensors, which
                SGLang's loaders skip with a warning (the experts would stay stale).
        """
        self._weights.load_from_disk(path, version)

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Push Hugging Face-named tensors to every server and set ``version``. transformers'
        fused MoE expert tensors are sent as one tensor per expert, the names SGLang loads
        (:mod:`rl_core.moe_weights`; SGLang skips fused names with a warning)."""
        self._weights.load_tensors(named_tensors, version)

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory on every server for a colocated trainer: ``tags`` among
        :data:`~rl_sglang._weights.MEMORY_TAGS` (``None``: all of them). New requests wait until
        :meth:`resume_memory`.

        Needs servers on CUDA launched with ``enable_memory_saver`` (``supports_memory_release``);
        refused otherwise (on CPU SGLang's handler calls ``torch.cuda.synchronize`` and the
        server dies)."""
        await self._memory("/release_memory_occupation", memory_tags(tags))

    async def resume_memory(
        self, tags: Sequence[str] | None = None, *, reload_weights: bool = True
    ) -> None:
        """Undo :meth:`release_memory` for ``tags`` (``None``: all). When ``weights`` come back
        and ``reload_weights`` is true, every server reloads the current weights and version
        (the last update's source, or the checkpoint it was launched with): released weight
        memory comes back uninitialised. Pass ``reload_weights=False`` when an update follows
        at once (the colocated loop pushes new weights right after)."""
        want = memory_tags(tags)
        await self._memory("/resume_memory_occupation", want)
        if reload_weights and (want is None or "weights" in want):
            await self._weights.reload()

    async def _memory(self, path: str, tags: list[str] | None) -> None:
        if not self.supports_memory_release:
            raise GenerationError(
                f"SGLangGenerator{path}: the servers cannot release memory (they need "
                "device='cuda' and SGLangGenerator.Config.enable_memory_saver=true; on CPU the "
                "call kills the server). Check generator.supports_memory_release first."
            )
        await self._weights.memory(path, tags)

    # ------------------------------------------------------------------ LoRA adapters

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path (as loaded by this generator; adapter updates appear
        under their versioned names, e.g. ``task-v7``)."""
        return self._lora.adapters

    @property
    def lora_versions(self) -> dict[str, str]:
        """Adapters loaded by adapter-only weight updates: adapter name -> the versioned name it
        serves under now (requests may use either)."""
        return self._lora.versions

    @property
    def default_lora_adapter(self) -> str | None:
        """Adapter of requests that name none (``None``: the base model)."""
        return self._lora.default

    @default_lora_adapter.setter
    def default_lora_adapter(self, name: str | None) -> None:
        self._lora.default = name

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load the peft-format adapter at ``path`` under ``name`` on every server; a name that
        is already loaded is replaced (unloaded, then loaded: the way to publish new adapter
        weights). ``pinned`` keeps it from being evicted when more adapters are loaded than
        ``max_loaded_loras``."""
        await self._lora.load(name, path, pinned=pinned)

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name`` from every server; requests naming it are refused after."""
        await self._lora.unload(name)

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Stop the monitor, the router and launched servers; attached servers are left running
        (resumed if this generator paused them)."""
        if self._fleet.closed:
            return
        if self.paused and any(s.proc is None for s in self._fleet.servers):
            try:
                await self.resume()
            except Exception as e:  # closing goes on; the servers stay paused, say so
                log.warning(
                    "SGLangGenerator.close: could not resume the attached servers %s (%s: %s); "
                    "they stay paused until /continue_generation is called.",
                    self.server_urls,
                    type(e).__name__,
                    e,
                )
        self._fleet.closed = True
        await asyncio.to_thread(self._finalizer)
        self._weights.close()

    def __repr__(self) -> str:
        return f"SGLangGenerator(servers={self.server_urls}, version={self.weight_version})"


def _cleanup(procs: list[ManagedProcess], io: IOLoop) -> None:
    io.cancel_tasks()  # no monitor may restart what is being stopped
    for p in list(procs):
        p.stop()
    io.close()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _eos_ids(model_dir: Path | None) -> tuple[int, ...]:
    if model_dir is None:
        return ()
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        cfg = _read_json(model_dir / name)
        for key in ("eos_token_id", "pad_token_id"):
            v = cfg.get(key)
            out.update(int(x) for x in (v if isinstance(v, list) else [v]) if x is not None)
    return tuple(sorted(out))


def _vocab_size(model_dir: Path | None) -> int | None:
    if model_dir is None:
        return None
    v = _read_json(model_dir / "config.json").get("vocab_size")
    return int(v) if v is not None else None
