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
(:mod:`rl_trainer.truncation`).

Seeds: SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``, which
needs a GPU attention backend; on CPU, seeded requests are sent with their seed but sampling is
not reproducible.

Layout: this module holds the config, start-up and shutdown; the class gets its request handling
from ``_requests``, abort/pause/health/restart from ``_control``, weight updates from
``_weights`` and its HTTP helpers from ``_http`` (mixins over the shared state in ``_state``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

from rl_core.config import (
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Range,
    Seed,
    check_ranges,
)
from rl_core.errors import ConfigError
from rl_core.interfaces import Generator
from rl_sglang._control import _ControlMixin
from rl_sglang._http import _HTTPMixin
from rl_sglang._io import IOLoop
from rl_sglang._launch import (
    TYPED_SERVER_ARGS,
    check_gpu_budget,
    typed_server_args,
    visible_gpus,
)
from rl_sglang._lora import _LoRAMixin
from rl_sglang._requests import _RequestsMixin
from rl_sglang._routing import RoutingLayout, check_servable
from rl_sglang._state import PAUSE_MODES, _Live, _Server
from rl_sglang._weights import _WeightsMixin
from rl_sglang.server import (
    ManagedProcess,
    ServerArgs,
    free_port,
    launch_router,
    launch_server,
    wait_healthy,
)

__all__ = ["PAUSE_MODES", "SGLangGenerator"]

log = logging.getLogger(__name__)


class SGLangGenerator(
    _RequestsMixin, _ControlMixin, _WeightsMixin, _LoRAMixin, _HTTPMixin, Generator
):
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
        self._version = c.initial_version
        self._updating = False
        self._paused: str | None = None
        self._closed = False
        self._seed_rng = random.Random(c.seed)
        self._live: dict[str, list[_Live]] = {}
        self._abort_epoch = 0  # bumped by abort-all; generate() calls from before it are aborted
        self._source: tuple[str, Any] | None = None  # how to re-sync a restarted server
        self._router: ManagedProcess | None = None
        self._router_sem: asyncio.Semaphore | None = None
        self._background: set[asyncio.Future[Any]] = set()
        self.router_url: str | None = c.router_url.rstrip("/") if c.router_url else None
        """URL ``/generate`` traffic goes to when a router is used."""
        self._io = IOLoop("SGLangGenerator-io", max_connections=0)
        self._procs: list[ManagedProcess] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, self._io)
        self._servers: list[_Server] = []
        try:
            self._start()
        except BaseException:
            self._finalizer()
            raise
        model_dir = self._model_dir()
        if self.routing_layout is None:
            self.routing_layout = RoutingLayout.from_model_dir(model_dir)
        info = getattr(self, "_server_info", {})
        captures = bool(info.get("enable_return_routed_experts"))
        self.supports_routing = captures and self.routing_layout is not None  # type: ignore[misc]
        self.supports_lora: bool = bool(info.get("enable_lora"))
        """The servers serve LoRA adapters (launched with ``enable_lora``)."""
        self.supports_lora_adapters = self.supports_lora  # type: ignore[misc]
        self._lora: dict[str, str] = {}
        self._lora_alias: dict[str, str] = {}  # adapter name -> versioned name (adapter updates)
        self._default_lora: str | None = None
        self.supports_memory_release = (  # type: ignore[misc]
            bool(info.get("enable_memory_saver")) and str(info.get("device")) != "cpu"
        )
        self.vocab_size: int | None = _vocab_size(model_dir)
        """Rows of the served model's LM head (``None`` if the checkpoint is not readable)."""
        eos = _eos_ids(model_dir) if c.stop_on_eos else ()
        self.default_stop_ids: tuple[int, ...] = tuple(sorted({*eos, *c.extra_stop_token_ids}))
        """Stop ids sent with every request (EOS and PAD, plus ``extra_stop_token_ids``)."""
        self._monitor: Any = None
        if c.health_interval_s > 0:
            self._monitor = self._io.submit(self._health_loop())

    # ------------------------------------------------------------------ start-up

    def _launch(self, port: int, index: int) -> ManagedProcess:
        proc = launch_server(
            model_path=self.config.model_path,
            python=self.python,
            port=port,
            server_args={**self.server_args, **typed_server_args(self.config, index)},
            device=self.config.device,
            log_dir=self.log_dir,
            host=self.config.host,
            name=f"sglang-{index}",
            weight_version=self.config.initial_version,
        )
        self._procs.append(proc)
        return proc

    async def _launch_on_loop(self, port: int, index: int) -> ManagedProcess:
        return self._launch(port, index)

    def _start(self) -> None:
        c = self.config
        sem_total = c.max_concurrency
        if self.owned:
            ports = [free_port(c.host) for _ in range(c.num_servers)]
            # Launched from the IO thread, which lives as long as the generator: the servers'
            # parent-death signal is tied to the launching thread.
            procs = [self._io.call(self._launch_on_loop(p, i)) for i, p in enumerate(ports)]
            urls = [f"http://{c.host}:{p}" for p in ports]
            for proc, url in zip(procs, urls):
                wait_healthy(proc, url, timeout_s=c.startup_timeout_s)
            # External engines registered next to the launched servers (never owned).
            procs += [None] * len(c.external_urls)
            urls += list(c.external_urls)
            ports += [_port(u) for u in c.external_urls]
        else:
            procs = [None] * len(c.server_urls)
            urls = list(c.server_urls)
            ports = [_port(u) for u in urls]

        async def make() -> None:
            for i, (url, port, proc) in enumerate(zip(urls, ports, procs)):
                s = _Server(i, url, port, proc, asyncio.Semaphore(sem_total))
                info = await self._get_json(s, "/get_server_info", timeout=30)
                s.tp_size = int(info.get("tp_size") or 1)
                s.up = True
                self._servers.append(s)
                self._server_info = info
            # Stamp the version the caller says the attached servers' weights are.
            attached = [s for s in self._servers if s.proc is None]
            await asyncio.gather(*(self._set_version(s, self._version) for s in attached))

        self._io.call(make())
        if c.use_router:
            port = free_port(c.host)

            async def start_router() -> ManagedProcess:
                return launch_router(
                    worker_urls=urls,
                    python=self.python,
                    port=port,
                    log_dir=self.log_dir,
                    host=c.host,
                    policy=c.router_policy,
                )

            self._router = self._io.call(start_router())
            self._procs.append(self._router)
            self.router_url = f"http://{c.host}:{port}"
            wait_healthy(self._router, self.router_url, timeout_s=120, path="/health")
        if self.router_url is not None:

            async def router_sem() -> None:
                self._router_sem = asyncio.Semaphore(sem_total * len(self._servers))

            self._io.call(router_sem())

    def _model_dir(self) -> Path | None:
        path = self.config.model_path or getattr(self, "_server_info", {}).get("model_path")
        return Path(path) if path and Path(path).is_dir() else None

    # ------------------------------------------------------------------ properties

    @property
    def weight_version(self) -> int:
        """Version of the weights the servers serve."""
        return self._version

    @property
    def server_urls(self) -> list[str]:
        """URLs of the servers (launched or attached), in index order."""
        return [s.url for s in self._servers]

    @property
    def server_processes(self) -> list[ManagedProcess | None]:
        """The launcher process of each server (``None`` for attached ones)."""
        return [s.proc for s in self._servers]

    def servers_up(self) -> list[bool]:
        """Whether each server is in rotation."""
        return [s.up for s in self._servers]

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Stop the monitor, the router and launched servers; attached servers are left running
        (resumed if this generator paused them)."""
        if self._closed:
            return
        if self._paused and any(s.proc is None for s in self._servers):
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
        self._closed = True
        await asyncio.to_thread(self._finalizer)

    def __repr__(self) -> str:
        return f"SGLangGenerator(servers={self.server_urls}, version={self._version})"


def _cleanup(procs: list[ManagedProcess], io: IOLoop) -> None:
    io.cancel_tasks()  # no monitor may restart what is being stopped
    for p in list(procs):
        p.stop()
    io.close()


def _port(url: str) -> int:
    """The port of a server URL (``http://host:port``)."""
    return int(url.rsplit(":", 1)[1].split("/")[0])


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
