"""SGLangTopology: several named SGLang server groups behind one :class:`Generator`.

Each group is an :class:`~rl_sglang.generator.SGLangGenerator` with its own launch options, its
own router and, optionally, external engines (running servers given by URL) registered into it.
A group either serves the policy (``serves_policy: true``, the default: it serves the run's
model and receives every weight update) or another model that stays fixed (a judge, a teacher,
a frozen copy of the initial policy: never updated). Declared in the recipe::

    generator:
      type: sglang_topology
      defaults: {server_args: {log_level: warning, max_total_tokens: 4096}}
      groups:
        - name: policy                 # launched, behind its own router
          num_servers: 2
          use_router: true
        - name: judge                  # another model, never updated
          serves_policy: false
          model_path: /models/judge
        - name: remote                 # external engines of the policy, plus one launched
          num_servers: 1
          server_urls: [http://10.0.0.5:30000]

A group takes every :class:`SGLangGenerator.Config` option (``defaults`` holds the ones shared
by all groups; a group's own options win, ``server_args`` are merged key by key) plus ``name``,
``serves_policy`` and ``worker_type``. ``server_urls`` in a group are external engines
registered into it; ``num_servers`` (servers to launch) defaults to 1 without ``server_urls``
and to 0 with them. A group serving the policy serves the run's ``model_path``; another group
serves its own ``model_path`` (default: the run's, i.e. a frozen copy of the initial weights).
With ``defaults.log_dir`` each group logs under ``<log_dir>/<name>``.

The rollout function addresses a group by name through the generator it is given::

    async def judge_and_answer(prompt, ctx):
        answer = await ctx.generate(prompt.input_ids, request_id=...)      # the default group
        judge = ctx.generator.group("judge")                               # an SGLangGenerator
        (verdict,) = await judge.generate([GenerationRequest(...)])

The topology itself is the run's generator: :meth:`~SGLangTopology.generate` (the trainer's default
single-turn path and ``ctx.generate``) goes to ``default_group`` (default: the first group serving
the policy); weight updates, abort, pause and memory release go to every group serving the policy;
:meth:`~SGLangTopology.close` stops all groups.

Prefill/decode disaggregation (``worker_type: prefill`` / ``decode``, or SGLang's
``disaggregation_mode``) is refused: SGLang has no PD mode on CPU, and on CUDA it needs the
router's PD mode and a KV transfer backend, which rl-sglang does not drive yet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from rl_core.config import Seed, from_dict
from rl_core.errors import ConfigError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.types import GenerationRequest, GenerationResult, WeightUpdate
from rl_sglang._launch import typed_server_args
from rl_sglang.generator import SGLangGenerator
from rl_sglang.server import ServerArgs, server_argv

__all__ = ["GroupPlan", "SGLangTopology"]

log = logging.getLogger(__name__)

WHERE = "generator"
"""How error messages name the topology's options (its recipe section)."""

GROUP_KEYS = ("name", "serves_policy", "worker_type")
"""Options of a group that are not :class:`SGLangGenerator.Config` fields."""

WORKER_TYPES = ("regular", "prefill", "decode")
"""SGLang worker roles; only ``regular`` is supported (see the module docstring)."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One validated group of a topology: its name, role and generator config."""

    name: str
    """The group's name (``ctx.generator.group(name)``)."""
    serves_policy: bool
    """The group serves the trained model and receives every weight update."""
    config: SGLangGenerator.Config
    """The group's generator config (launch options, external engines, router)."""

    def argv(self, index: int, *, python: str, port: int, nccl_port: int) -> list[str]:
        """The command line the group's launched server ``index`` runs (what
        :class:`SGLangGenerator` passes to :func:`~rl_sglang.server.launch_server`, CPU
        defaults included), with the server arguments not yet checked against SGLang's
        parser."""
        from rl_sglang import _cpu_support

        c = self.config
        args = {**ServerArgs.check_keys(c.server_args), **typed_server_args(c, index)}
        if c.device == "cpu":
            args = _cpu_support.cpu_server_args(args)
        return server_argv(
            model_path=c.model_path,
            python=python,
            port=port,
            server_args=args,
            device=c.device,
            host=c.host,
            nccl_port=nccl_port,
            weight_version=c.initial_version,
        )


class SGLangTopology(Generator):
    """Named SGLang server groups, each an :class:`SGLangGenerator`; see the module docstring."""

    supports_abort: ClassVar[bool] = True
    """:meth:`abort` ends the policy groups' requests with their partial tokens."""
    supports_pause: ClassVar[bool] = True
    """:meth:`pause` holds the policy groups' new requests."""
    supports_memory_release: ClassVar[bool] = True
    """An instance says ``True`` only when every policy group can release memory."""
    supports_routing: ClassVar[bool] = True
    """An instance says what its default group says."""
    one_per_run: ClassVar[bool] = True
    """It launches and owns every group itself, so a run builds exactly one (rl-train on Ray:
    ``runtime.generator.count: 0``, the topology runs in the driver)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`SGLangTopology`."""

        model_path: str = ""
        """The policy's checkpoint: what groups with ``serves_policy`` launch (set by rl-train
        to the run's model)."""
        seed: Seed = 0
        """Seeds the groups' request seeds (group ``i`` gets ``seed + i``)."""
        groups: tuple[dict[str, Any], ...] = ()
        """The server groups: ``name``, ``serves_policy`` (default true), ``worker_type``
        (``regular``) and any :class:`SGLangGenerator.Config` option (``num_servers``,
        ``server_urls`` = external engines, ``use_router``, ``server_args``, ...)."""
        defaults: dict[str, Any] = field(default_factory=dict)
        """:class:`SGLangGenerator.Config` options shared by every group (``python``,
        ``server_args``, ``log_dir``, ``max_concurrency``, ...); a group's own options win."""
        default_group: str | None = None
        """The group :meth:`SGLangTopology.generate` uses (a policy group); ``None``: the first
        group with ``serves_policy``."""

        def __post_init__(self) -> None:
            self.groups = tuple(dict(g) if isinstance(g, Mapping) else g for g in self.groups)
            self.defaults = dict(self.defaults)
            self.plan()

        def plan(self) -> list[GroupPlan]:
            """The validated groups, in declaration order (raises :class:`ConfigError` naming
            the field and the fix)."""
            if not self.groups:
                raise ConfigError(
                    f"{WHERE}.groups: declare at least one group, e.g. groups: [{{name: policy, "
                    "num_servers: 1}}] (for a single group, generator type 'sglang' is simpler)."
                )
            defaults = self._checked_defaults()
            plans: list[GroupPlan] = []
            seen: dict[str, int] = {}
            url_owner: dict[str, str] = {}
            for i, raw in enumerate(self.groups):
                plan = self._plan_group(i, raw, defaults)
                if plan.name in seen:
                    raise ConfigError(
                        f"{WHERE}.groups[{i}].name: {plan.name!r} is already the name of "
                        f"groups[{seen[plan.name]}]; group names must be unique."
                    )
                seen[plan.name] = i
                c = plan.config
                for url in (*c.server_urls, *c.external_urls):
                    if url in url_owner:
                        raise ConfigError(
                            f"{WHERE}.groups[{i}].server_urls: {url} is already in group "
                            f"{url_owner[url]!r}; a server belongs to one group (it would get "
                            "that group's weight updates too)."
                        )
                    url_owner[url] = plan.name
                plans.append(plan)
            _check_gpu_blocks(plans)
            policy = [p for p in plans if p.serves_policy]
            if not policy:
                raise ConfigError(
                    f"{WHERE}.groups: no group serves the policy; set serves_policy: true on "
                    "the group(s) that sample the trained model (they get the weight updates)."
                )
            paths = {
                str(Path(p.config.model_path).resolve()) for p in policy if p.config.model_path
            }
            if len(paths) > 1:
                raise ConfigError(
                    f"{WHERE}.groups: the groups serving the policy name different model_path "
                    f"values {sorted(paths)}; they serve one model, so set model_path once "
                    f"({WHERE}.model_path) or set serves_policy: false on the other groups."
                )
            versions = {p.config.initial_version for p in policy}
            if len(versions) > 1:
                raise ConfigError(
                    f"{WHERE}.groups: the policy groups start on different initial_version "
                    f"values {sorted(versions)}; they serve the same weights, so set one "
                    "initial_version (in defaults)."
                )
            if self.default_group is not None:
                match = [p for p in plans if p.name == self.default_group]
                if not match:
                    raise ConfigError(
                        f"{WHERE}.default_group: no group named {self.default_group!r}; groups: "
                        f"{[p.name for p in plans]}."
                    )
                if not match[0].serves_policy:
                    raise ConfigError(
                        f"{WHERE}.default_group: {self.default_group!r} does not serve the "
                        "policy (serves_policy: false), but the default group samples the "
                        "trained rollouts; name a policy group or drop default_group."
                    )
            return plans

        def _checked_defaults(self) -> dict[str, Any]:
            known = {f.name for f in dataclasses.fields(SGLangGenerator.Config)}
            for key in self.defaults:
                if key in GROUP_KEYS or key in ("server_urls", "external_urls"):
                    raise ConfigError(
                        f"{WHERE}.defaults.{key}: belongs to one group; set it in "
                        f"{WHERE}.groups[...] instead."
                    )
                if key == "model_path":
                    raise ConfigError(
                        f"{WHERE}.defaults.model_path: policy groups serve the run's model; set "
                        "model_path on the groups with serves_policy: false instead."
                    )
                if key not in known:
                    raise ConfigError(
                        f"{WHERE}.defaults.{key}: unknown option of SGLangGenerator.Config; "
                        f"known: {', '.join(sorted(known - {'model_path', 'server_urls'}))}."
                    )
            return dict(self.defaults)

        def _plan_group(self, i: int, raw: Any, defaults: dict[str, Any]) -> GroupPlan:
            where = f"{WHERE}.groups[{i}]"
            if not isinstance(raw, Mapping):
                raise ConfigError(
                    f"{where}: a table (name, num_servers, ...) expected, got {raw!r}."
                )
            opts = dict(raw)
            name = opts.pop("name", None)
            if not isinstance(name, str) or not _NAME.match(name):
                raise ConfigError(
                    f"{where}.name: every group needs a name of letters, digits, '_', '-' or "
                    f"'.' (got {name!r}), e.g. name: policy."
                )
            where = f"{where} ({name!r})"
            serves_policy = opts.pop("serves_policy", True)
            if not isinstance(serves_policy, bool):
                raise ConfigError(f"{where}.serves_policy: true or false, got {serves_policy!r}.")
            worker_type = opts.pop("worker_type", "regular")
            if "external_urls" in opts:
                raise ConfigError(
                    f"{where}.external_urls: in a group, list external engines in server_urls "
                    "(with num_servers > 0 to launch more next to them)."
                )
            for src, label in ((defaults, f"{WHERE}.defaults"), (opts, where)):
                if not isinstance(src.get("server_args", {}), Mapping):
                    raise ConfigError(
                        f"{label}.server_args: a table of SGLang ServerArgs fields expected, "
                        f"got {src['server_args']!r}."
                    )
            merged = {**defaults, **opts}
            merged["server_args"] = {
                **defaults.get("server_args", {}),
                **opts.get("server_args", {}),
            }
            device = merged.get("device", "cpu")
            _refuse_pd(where, worker_type, merged["server_args"], device)
            urls = tuple(opts.get("server_urls", ()))
            launch = opts.get("num_servers", 0 if urls else defaults.get("num_servers", 1))
            if not isinstance(launch, int) or isinstance(launch, bool) or launch < 0:
                raise ConfigError(f"{where}.num_servers: an integer >= 0, got {launch!r}.")
            if launch == 0 and not urls:
                raise ConfigError(
                    f"{where}: neither servers to launch (num_servers: 0) nor external engines "
                    "(server_urls); set num_servers >= 1 or list the running servers in "
                    "server_urls."
                )
            own_path = opts.get("model_path")
            if (
                serves_policy
                and own_path
                and self.model_path
                and not _same_path(own_path, self.model_path)
            ):
                raise ConfigError(
                    f"{where}.model_path: {own_path} differs from the policy's model "
                    f"{self.model_path or '(unset)'}, but the group serves the policy (it gets "
                    "the policy's weight updates); drop model_path, or set serves_policy: false "
                    "for a group serving another model."
                )
            merged["model_path"] = own_path or self.model_path
            if launch and not merged["model_path"]:
                raise ConfigError(
                    f"{where}: launches {launch} server(s) but has no model to serve; set "
                    f"{WHERE}.model_path (rl-train sets it to the policy's model)"
                    + ("" if serves_policy else " or the group's model_path")
                    + "."
                )
            merged.setdefault("seed", self.seed + i)
            if "log_dir" in defaults and "log_dir" not in opts and defaults["log_dir"]:
                merged["log_dir"] = str(Path(defaults["log_dir"]) / name)
            merged.pop("server_urls", None)
            merged.pop("num_servers", None)
            if launch:
                merged.update(num_servers=launch, external_urls=urls)
            else:
                merged["server_urls"] = urls
            try:
                config = from_dict(SGLangGenerator.Config, merged, path=where)
            except ConfigError as e:
                msg = str(e)
                raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from None
            return GroupPlan(name=name, serves_policy=serves_policy, config=config)

    def __init__(
        self,
        config: SGLangTopology.Config,
        *,
        make_group: Callable[[SGLangGenerator.Config], Generator] | None = None,
    ) -> None:
        """Start every group (concurrently) and wait until all are healthy; a group that fails
        to start stops the others. ``make_group`` builds a group's generator from its config
        (default :class:`SGLangGenerator`; tests pass fakes)."""
        self.config = config
        self.plans: tuple[GroupPlan, ...] = tuple(config.plan())
        """The validated groups, in declaration order."""
        make = make_group or SGLangGenerator
        self._groups: dict[str, Generator] = {}
        with ThreadPoolExecutor(max_workers=len(self.plans)) as pool:
            futures = [(p.name, pool.submit(make, p.config)) for p in self.plans]
            errors: list[tuple[str, BaseException]] = []
            for name, fut in futures:
                try:
                    self._groups[name] = fut.result()
                except BaseException as e:  # stop the groups already started, then raise
                    errors.append((name, e))
        if errors:
            for gen in self._groups.values():
                _stop_now(gen)
            name, first = errors[0]
            first.add_note(f"(while starting {WHERE}.groups {name!r})")
            raise first
        self.policy_groups: tuple[str, ...] = tuple(p.name for p in self.plans if p.serves_policy)
        """Names of the groups serving the policy (they receive the weight updates)."""
        self.default_group: str = config.default_group or self.policy_groups[0]
        """The group :meth:`generate` uses."""
        policy = [self._groups[n] for n in self.policy_groups]
        self.supports_memory_release = all(  # type: ignore[misc]
            getattr(g, "supports_memory_release", False) for g in policy
        )
        self.supports_routing = bool(  # type: ignore[misc]
            getattr(self._groups[self.default_group], "supports_routing", False)
        )
        self.supports_lora_adapters = all(  # type: ignore[misc]
            getattr(g, "supports_lora_adapters", False) for g in policy
        )
        self._closed = False

    # ------------------------------------------------------------------ groups

    def group(self, name: str) -> Generator:
        """The generator of group ``name`` (an :class:`SGLangGenerator`)."""
        try:
            return self._groups[name]
        except KeyError:
            raise ConfigError(
                f"SGLangTopology.group: no group named {name!r}; the recipe declares "
                f"{list(self._groups)} (generator.groups[*].name)."
            ) from None

    @property
    def groups(self) -> Mapping[str, Generator]:
        """Every group's generator by name (read-only), in declaration order."""
        return MappingProxyType(self._groups)

    @property
    def vocab_size(self) -> int | None:
        """Rows of the LM head of the default group's model."""
        return getattr(self._groups[self.default_group], "vocab_size", None)

    @property
    def default_stop_ids(self) -> tuple[int, ...]:
        """Stop ids the default group sends with every request."""
        return tuple(getattr(self._groups[self.default_group], "default_stop_ids", ()))

    def _policy(self) -> list[Generator]:
        return [self._groups[n] for n in self.policy_groups]

    # ------------------------------------------------------------------ Generator

    @property
    def weight_version(self) -> int:
        """The weight version every policy group serves (the lowest, if an update failed
        half-way)."""
        return min(g.weight_version for g in self._policy())

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve ``requests`` on the default group."""
        return await self._groups[self.default_group].generate(requests)

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Load ``update`` on every policy group, one group after the other (groups serving
        another model keep their weights). A failure raises; groups already updated keep the
        new version (:attr:`weight_version` stays the lowest)."""
        from rl_sglang.collective import SGLangCollectiveTransport

        if isinstance(transport, SGLangCollectiveTransport) and len(self.policy_groups) > 1:
            raise ConfigError(
                "weight_transport.type: sglang_collective broadcasts into one group's servers, "
                f"but {len(self.policy_groups)} groups serve the policy "
                f"({list(self.policy_groups)}); use disk_full, disk_delta or inprocess, or "
                "serve the policy from one group (num_servers, server_urls)."
            )
        for g in self._policy():
            await g.update_weights(update, transport)

    async def health(self) -> bool:
        """True when every group can serve."""
        return all(await asyncio.gather(*(g.health() for g in self._groups.values())))

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given (or all) requests of the policy groups."""
        await asyncio.gather(*(g.abort(request_ids) for g in self._policy()))

    async def pause(self, mode: str | None = None) -> None:
        """Pause the policy groups (``mode`` as :meth:`SGLangGenerator.pause`)."""
        await asyncio.gather(*(_pause(g, mode) for g in self._policy()))

    async def resume(self) -> None:
        """Resume the policy groups."""
        await asyncio.gather(*(g.resume() for g in self._policy()))

    async def release_memory(self) -> None:
        """Release the policy groups' device memory."""
        await asyncio.gather(*(g.release_memory() for g in self._policy()))

    async def resume_memory(self) -> None:
        """Undo :meth:`release_memory`."""
        await asyncio.gather(*(g.resume_memory() for g in self._policy()))

    async def close(self) -> None:
        """Close every group (launched servers and routers stop; external engines stay)."""
        if self._closed:
            return
        self._closed = True
        results = await asyncio.gather(
            *(g.close() for g in self._groups.values()), return_exceptions=True
        )
        for name, r in zip(self._groups, results):
            if isinstance(r, BaseException):
                log.warning("SGLangTopology.close: group %r: %s: %s", name, type(r).__name__, r)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={g!r}" for n, g in self._groups.items())
        return f"SGLangTopology({inner})"


async def _pause(gen: Generator, mode: str | None) -> None:
    if mode is None:
        await gen.pause()
    else:
        await gen.pause(mode)  # type: ignore[call-arg]


def _stop_now(gen: Generator) -> None:
    """Stop a started group from synchronous code (its processes and IO thread)."""
    finalizer = getattr(gen, "_finalizer", None)
    if finalizer is not None:
        finalizer()
        return
    try:
        asyncio.run(gen.close())
    except RuntimeError:  # inside a running loop: nothing more can be done synchronously
        log.warning("SGLangTopology: could not close %r after a failed start-up.", gen)


def _check_gpu_blocks(plans: Sequence[GroupPlan]) -> None:
    """Refuse groups whose launched CUDA servers would share GPUs of this node."""
    taken: list[tuple[int, int, int, str]] = []  # first GPU, end, group index, name
    for i, p in enumerate(plans):
        c = p.config
        if c.device != "cuda" or c.server_urls:
            continue
        first = c.base_gpu_id
        end = first + c.num_servers * c.tp_size * c.dp_size
        for o_first, o_end, j, other in taken:
            if first < o_end and o_first < end:
                raise ConfigError(
                    f"{WHERE}.groups[{i}].base_gpu_id: group {p.name!r} would launch on GPUs "
                    f"{first}..{end - 1}, which overlap GPUs {o_first}..{o_end - 1} of "
                    f"groups[{j}] ({other!r}); give each group its own GPUs, e.g. base_gpu_id: "
                    f"{o_end}."
                )
        taken.append((first, end, i, p.name))


def _same_path(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _refuse_pd(where: str, worker_type: Any, server_args: Mapping[str, Any], device: str) -> None:
    """Refuse prefill/decode disaggregation, with the reason for this device."""
    if worker_type not in WORKER_TYPES:
        raise ConfigError(
            f"{where}.worker_type: {worker_type!r} is not one of {WORKER_TYPES}; use 'regular'."
        )
    mode = server_args.get("disaggregation_mode", server_args.get("disaggregation-mode"))
    if worker_type == "regular" and mode in (None, "null"):
        return
    field_name = "worker_type" if worker_type != "regular" else "server_args.disaggregation_mode"
    role = worker_type if worker_type != "regular" else mode
    why = (
        "SGLang has no prefill/decode disaggregation on CPU"
        if device == "cpu"
        else "rl-sglang does not drive SGLang's PD mode yet (it needs the router's PD mode and "
        "a KV transfer backend)"
    )
    raise ConfigError(
        f"{where}.{field_name}: {role!r} asks for prefill/decode disaggregation, but {why}; "
        "use regular groups (worker_type: regular) and more servers or groups instead."
    )
