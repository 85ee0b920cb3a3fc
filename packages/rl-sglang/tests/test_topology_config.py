"""SGLang topologies (``generator: {type: sglang_topology}``): group validation, each group's
command line, and how the topology routes requests and weight updates to its groups (fake
groups). No server is started."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core import registry
from rl_core.config import ComponentSpec, from_dict
from rl_core.errors import ConfigError
from rl_core.testing import FakeGenerator
from rl_core.testing.generator import GeneratorConformance
from rl_core.types import GenerationRequest, SamplingParams, WeightUpdate
from rl_sglang import ManagedProcess, ServerArgs, SGLangGenerator, SGLangTopology
from rl_sglang.server import free_port, wait_healthy
from rl_sglang.topology import GroupPlan

MODEL = "/models/policy"


def _cfg(groups: list[dict[str, Any]], **kw: Any) -> SGLangTopology.Config:
    """The topology config as rl-train builds it: recipe options plus the run's model path."""
    return from_dict(
        SGLangTopology.Config,
        {"model_path": MODEL, "seed": 7, "groups": groups, **kw},
        path="generator",
    )


def _plans(groups: list[dict[str, Any]], **kw: Any) -> dict[str, GroupPlan]:
    return {p.name: p for p in _cfg(groups, **kw).plan()}


TWO = [
    {"name": "policy", "num_servers": 2, "use_router": True},
    {"name": "judge", "serves_policy": False, "model_path": "/models/judge"},
]


def test_groups_inherit_defaults_and_keep_their_own_options() -> None:
    """``defaults`` reach every group, a group's own options win (``server_args`` merged key by
    key), policy groups serve the run's model, and each group logs in its own directory."""
    plans = _plans(
        [
            *TWO,
            {"name": "remote", "server_urls": ["http://10.0.0.5:30000/"]},
            {"name": "mixed", "num_servers": 1, "server_urls": ["http://10.0.0.6:30000"]},
        ],
        defaults={
            "python": "/venv/bin/python",
            "log_dir": "/logs",
            "max_concurrency": 16,
            "server_args": {"log_level": "warning", "max_total_tokens": 4096},
        },
    )
    policy, judge, remote, mixed = (plans[n] for n in ("policy", "judge", "remote", "mixed"))
    assert [p.serves_policy for p in plans.values()] == [True, False, True, True]
    assert policy.config.model_path == MODEL and judge.config.model_path == "/models/judge"
    assert (policy.config.num_servers, policy.config.use_router) == (2, True)
    assert not judge.config.use_router and judge.config.num_servers == 1
    assert all(p.config.max_concurrency == 16 for p in plans.values())
    assert policy.config.log_dir == "/logs/policy" and judge.config.log_dir == "/logs/judge"
    assert [p.config.seed for p in plans.values()] == [7, 8, 9, 10]
    # External engines: attach-only without num_servers, launched + registered with it.
    assert remote.config.server_urls == ("http://10.0.0.5:30000",)
    assert remote.config.external_urls == ()
    assert mixed.config.server_urls == () and mixed.config.num_servers == 1
    assert mixed.config.external_urls == ("http://10.0.0.6:30000",)
    merged = _plans(
        [{"name": "a", "server_args": {"max_total_tokens": 2048, "chunked_prefill_size": 512}}],
        defaults={"server_args": {"log_level": "warning", "max_total_tokens": 4096}},
    )["a"]
    assert merged.config.server_args == {
        "log_level": "warning",
        "max_total_tokens": 2048,
        "chunked_prefill_size": 512,
    }


def test_cuda_groups_on_disjoint_gpus() -> None:
    plans = _plans(
        [
            {"name": "a", "device": "cuda", "num_servers": 2, "tp_size": 2},
            {"name": "j", "device": "cuda", "serves_policy": False, "base_gpu_id": 4},
        ]
    )
    assert plans["j"].config.base_gpu_id == 4


def test_command_line_per_group() -> None:
    """Each group's launched servers run with that group's model and options only."""
    plans = _plans(
        [
            {"name": "policy", "server_args": {"max_total_tokens": 2048}},
            {
                "name": "judge",
                "serves_policy": False,
                "model_path": "/models/judge",
                "server_args": {"chunked_prefill_size": 256},
                "initial_version": 5,
            },
            {
                "name": "gpu",
                "serves_policy": False,
                "model_path": "/models/big",
                "device": "cuda",
                "num_servers": 2,
                "tp_size": 2,
                "mem_fraction_static": 0.6,
            },
        ],
        defaults={"server_args": {"log_level": "warning"}},
    )

    def argv(name: str, index: int = 0) -> str:
        return " ".join(
            plans[name].argv(index, python="/venv/bin/python", port=30000, nccl_port=40000)
        )

    policy, judge = argv("policy"), argv("judge")
    assert policy.startswith("/venv/bin/python -m sglang.launch_server --model-path /models/policy")
    for flag in ("--device cpu", "--max-total-tokens 2048", "--log-level warning", "--dtype"):
        assert flag in policy
    assert "--chunked-prefill-size" not in policy and "--weight-version 0" in policy
    assert "--model-path /models/judge" in judge and "--weight-version 5" in judge
    assert "--chunked-prefill-size 256" in judge and "--max-total-tokens 2048" not in judge
    gpu0, gpu1 = argv("gpu", 0), argv("gpu", 1)
    assert "--device cuda" in gpu0 and "--tp-size 2" in gpu0 and "--mem-fraction-static 0.6" in gpu0
    assert "--base-gpu-id" not in gpu0 and "--base-gpu-id 2" in gpu1
    assert "--dtype" not in gpu0  # CPU defaults stay on CPU groups


@pytest.mark.parametrize(
    ("groups", "extra", "message"),
    [
        ([], {}, "generator.groups: declare at least one group"),
        ([{"num_servers": 1}], {}, "generator.groups[0].name: every group needs a name"),
        ([{"name": "a b"}], {}, "generator.groups[0].name"),
        ([{"name": "a"}, {"name": "a"}], {}, "generator.groups[1].name: 'a' is already"),
        (
            [{"name": "a", "num_servers": 0}],
            {},
            "generator.groups[0] ('a'): neither servers to launch",
        ),
        (
            [
                {"name": "a", "server_urls": ["http://h:1"]},
                {"name": "b", "server_urls": ["http://h:1/"]},
            ],
            {},
            "generator.groups[1].server_urls: http://h:1 is already in group 'a'",
        ),
        (
            [{"name": "a", "model_path": "/models/other"}],
            {},
            "generator.groups[0] ('a').model_path: /models/other differs from the policy's",
        ),
        (
            [{"name": "j", "serves_policy": False}],
            {},
            "generator.groups: no group serves the policy",
        ),
        (
            [{"name": "a"}, {"name": "b", "initial_version": 3}],
            {},
            "different initial_version",
        ),
        (
            [
                {"name": "a", "server_urls": ["http://h:1"], "model_path": "/m1"},
                {"name": "b", "server_urls": ["http://h:2"], "model_path": "/m2"},
            ],
            {"model_path": ""},
            "the groups serving the policy name different model_path values",
        ),
        (TWO, {"default_group": "nope"}, "generator.default_group: no group named 'nope'"),
        (TWO, {"default_group": "judge"}, "generator.default_group: 'judge' does not serve"),
        ([{"name": "a"}], {"defaults": {"name": "x"}}, "generator.defaults.name: belongs to one"),
        ([{"name": "a"}], {"defaults": {"server_urls": ["http://h:1"]}}, "defaults.server_urls"),
        ([{"name": "a"}], {"defaults": {"model_path": "/m"}}, "generator.defaults.model_path"),
        ([{"name": "a"}], {"defaults": {"num_server": 2}}, "defaults.num_server: unknown option"),
        ([{"name": "a", "num_server": 2}], {}, "generator.groups[0] ('a').num_server: unknown"),
        ([{"name": "a", "serves_policy": "yes"}], {}, "('a').serves_policy: true or false"),
        ([{"name": "a", "num_servers": -1}], {}, "('a').num_servers: an integer >= 0"),
        ([{"name": "a", "external_urls": ["http://h:1"]}], {}, "('a').external_urls: in a group"),
        ([{"name": "a", "server_args": [1]}], {}, "('a').server_args: a table"),
        (
            [{"name": "a", "use_router": True, "router_url": "http://r:1"}],
            {},
            "generator.groups[0] ('a'): SGLangGenerator.Config: use_router launches a router",
        ),
        (
            [{"name": "a", "tp_size": 2}],
            {},
            "generator.groups[0] ('a'): SGLangGenerator.Config.tp_size: a CUDA option",
        ),
        (
            [
                {"name": "a", "device": "cuda", "num_servers": 2, "tp_size": 2},
                {"name": "j", "device": "cuda", "serves_policy": False, "base_gpu_id": 3},
            ],
            {},
            "generator.groups[1].base_gpu_id: group 'j' would launch on GPUs 3..3, which "
            "overlap GPUs 0..3 of groups[0] ('a'); give each group its own GPUs, e.g. "
            "base_gpu_id: 4",
        ),
        # Prefill/decode disaggregation: refused with the reason for the device.
        (
            [{"name": "p", "worker_type": "prefill"}],
            {},
            "('p').worker_type: 'prefill' asks for prefill/decode disaggregation, but SGLang "
            "has no prefill/decode disaggregation on CPU",
        ),
        (
            [{"name": "d", "device": "cuda", "server_args": {"disaggregation_mode": "decode"}}],
            {},
            "('d').server_args.disaggregation_mode: 'decode' asks for prefill/decode "
            "disaggregation, but rl-sglang does not drive SGLang's PD mode",
        ),
        ([{"name": "a", "worker_type": "encoder"}], {}, "('a').worker_type: 'encoder' is not one"),
    ],
)
def test_invalid_topologies_name_the_field_and_the_fix(
    groups: list[dict[str, Any]], extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(groups, **extra)
    assert message in str(info.value)


def test_registered_as_a_generator_and_validated_like_one() -> None:
    """``sglang_topology`` is the package's entry point (as rl-train resolves it after
    installation) and the registry validates its options like any component's."""
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    ref = meta["project"]["entry-points"]["rl.generators"]["sglang_topology"]
    assert registry.load_object(ref) is SGLangTopology
    with pytest.raises(ConfigError, match=r"groups\[0\] \('a'\): launches 1 server\(s\) but"):
        registry.build(
            "generator",
            ComponentSpec(type=ref, options={"groups": [{"name": "a"}, {"name": "a"}]}),
            field="generator",
        )


class _Group(FakeGenerator):
    """A fake group that records what it was asked to do."""

    def __init__(self, config: SGLangGenerator.Config) -> None:
        super().__init__()
        self.group_config = config
        self.calls: list[str] = []
        self.closed = False

    async def generate(self, requests):  # type: ignore[no-untyped-def]
        self.calls.append("generate")
        return await super().generate(requests)

    async def update_weights(self, update, transport):  # type: ignore[no-untyped-def]
        self.calls.append(f"update:{update.version}")
        self._version = update.version

    @property
    def weight_version(self) -> int:
        return getattr(self, "_version", 0)

    async def pause(self, mode: str | None = None) -> None:
        self.calls.append(f"pause:{mode}")

    async def resume(self) -> None:
        self.calls.append("resume")

    async def abort(self, request_ids=None) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("abort")

    async def close(self) -> None:
        self.closed = True


def test_requests_go_to_the_default_group_and_updates_to_every_policy_group() -> None:
    """``generate`` samples the default group; ``group(name)`` reaches any group; weight
    updates, pause and abort reach the groups serving the policy and never the judge."""
    groups = [
        {"name": "judge", "serves_policy": False, "model_path": "/models/judge"},
        {"name": "policy"},
        {"name": "replica", "server_urls": ["http://10.0.0.5:30000"]},
    ]
    topo = SGLangTopology(_cfg(groups), make_group=_Group)
    judge, policy, replica = (topo.group(n) for n in ("judge", "policy", "replica"))
    assert list(topo.groups) == ["judge", "policy", "replica"]
    assert topo.default_group == "policy" and topo.policy_groups == ("policy", "replica")
    assert judge.group_config.model_path == "/models/judge"  # type: ignore[attr-defined]

    req = GenerationRequest(
        request_id="r0", input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=2)
    )
    (res,) = asyncio.run(topo.generate([req]))
    assert res.request_id == "r0"
    asyncio.run(judge.generate([req]))
    update = WeightUpdate(version=1, base_version=None, transport="inprocess")
    asyncio.run(topo.update_weights(update, transport=None))  # type: ignore[arg-type]
    asyncio.run(topo.pause("retract"))
    asyncio.run(topo.resume())
    asyncio.run(topo.abort())
    assert policy.calls == ["generate", "update:1", "pause:retract", "resume", "abort"]  # type: ignore[attr-defined]
    assert replica.calls == ["update:1", "pause:retract", "resume", "abort"]  # type: ignore[attr-defined]
    assert judge.calls == ["generate"]  # type: ignore[attr-defined]
    assert topo.weight_version == 1 and judge.weight_version == 0
    with pytest.raises(ConfigError, match=r"no group named 'teacher'.*\['judge', 'policy'"):
        topo.group("teacher")
    asyncio.run(topo.close())
    assert all(g.closed for g in topo.groups.values())  # type: ignore[attr-defined]


def test_a_group_that_fails_to_start_stops_the_others() -> None:
    started: list[_Group] = []

    def make(config: SGLangGenerator.Config) -> _Group:
        if config.model_path == "/models/judge":
            raise ConfigError("SGLangGenerator.Config.python: /nope does not exist")
        g = _Group(config)
        g._finalizer = lambda: setattr(g, "closed", True)  # type: ignore[attr-defined]
        started.append(g)
        return g

    with pytest.raises(ConfigError, match="does not exist") as info:
        SGLangTopology(_cfg(TWO), make_group=make)
    assert "generator.groups 'judge'" in "".join(getattr(info.value, "__notes__", []))
    assert [g.closed for g in started] == [True]


def test_judged_rollout_calls_both_groups() -> None:
    """The example rollout function samples answers from the default (policy) group and asks the
    judge group about prompt + answer; the verdict lands in the rollout's metadata."""
    from rl_core.interfaces import RolloutContext
    from rl_core.types import Prompt
    from rl_sglang.examples.judged import JudgedRollout

    topo = SGLangTopology(_cfg(TWO), make_group=_Group)
    seen: list[tuple[int, ...]] = []
    judge = topo.group("judge")
    plain_generate = judge.generate

    async def record(requests):  # type: ignore[no-untyped-def]
        seen.extend(r.input_ids for r in requests)
        return await plain_generate(requests)

    judge.generate = record  # type: ignore[method-assign]
    prompt = Prompt(uid="p0", input="x", token_ids=(3, 4, 5))
    ctx = RolloutContext(
        generator=topo,
        tokenizer=None,  # type: ignore[arg-type]
        sampling=SamplingParams(max_new_tokens=3, seed=11),
        n_samples=2,
        policy_version=0,
    )
    fn = JudgedRollout(JudgedRollout.Config(judge_tokens=2))
    rollouts = asyncio.run(fn(prompt, ctx))
    assert [r.sample_id for r in rollouts] == ["p0/0", "p0/1"]
    assert topo.group("policy").calls == ["generate"]  # type: ignore[attr-defined]
    for r, judged in zip(rollouts, seen):
        assert judged == r.tokens  # the judge saw prompt + answer
        verdict = r.metadata["judge"]
        assert verdict["group"] == "judge" and 1 <= len(verdict["tokens"]) <= 2
    ctx.generator = _Group(SGLangGenerator.Config(model_path=MODEL))
    with pytest.raises(ConfigError, match="use generator type sglang_topology"):
        asyncio.run(fn(prompt, ctx))
    asyncio.run(topo.close())


def test_external_urls_and_server_urls_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="SGLangGenerator.Config.external_urls: registers"):
        SGLangGenerator.Config(server_urls=("http://h:1",), external_urls=("http://h:2",))
    c = SGLangGenerator.Config(model_path=MODEL, external_urls=("http://h:2/",))
    assert c.external_urls == ("http://h:2",) and c.num_servers == 1


FAKE_SERVER = Path(__file__).with_name("_fake_sglang_server.py")


def _fake_process(port: int, log: Path, name: str) -> ManagedProcess:
    return ManagedProcess(
        [sys.executable, str(FAKE_SERVER), str(port), str(log)],
        env=dict(os.environ),
        log_path=log.with_suffix(".out"),
        cwd=log.parent,
        port=port,
        name=name,
    )


def _calls(log: Path) -> list[tuple[str, Any]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [(path, body) for method, path, body in map(json.loads, lines) if method == "POST"]


class _DiskTransport:
    """Hands a checkpoint directory to the target, as ``disk_full`` does once verified."""

    def apply(self, update: WeightUpdate, target: Any) -> None:
        target.load_weights_from_disk("/ckpt/v1", version=update.version)


def test_launched_and_external_servers_of_a_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A group with ``num_servers`` and ``server_urls`` launches its servers and registers the
    running ones next to them: the external engine is stamped with the group's version, gets the
    policy's weight updates with the launched server, and keeps running after close; the judge
    group's server gets no update. (Stdlib fake servers stand in for SGLang.)"""
    import rl_sglang._launch as launch_module

    launched: list[dict[str, Any]] = []

    def fake_launch(**kw: Any) -> ManagedProcess:
        launched.append(kw)
        log = tmp_path / f"{Path(kw['log_dir']).name}-{kw['port']}.jsonl"
        return _fake_process(kw["port"], log, kw["name"])

    monkeypatch.setattr(launch_module, "launch_server", fake_launch)
    monkeypatch.setattr(ServerArgs, "validate", staticmethod(lambda args, **_: dict(args)))
    ext_port = free_port()
    ext_log = tmp_path / "external.jsonl"
    external = _fake_process(ext_port, ext_log, "external")
    ext_url = f"http://127.0.0.1:{ext_port}"
    try:
        wait_healthy(external, ext_url, timeout_s=30)
        topo = SGLangTopology(
            _cfg(
                [
                    {"name": "policy", "num_servers": 1, "server_urls": [ext_url]},
                    {"name": "judge", "serves_policy": False},
                ],
                defaults={
                    "python": sys.executable,
                    "log_dir": str(tmp_path / "logs"),
                    "health_interval_s": 0,
                    "initial_version": 3,
                },
            )
        )
        policy = topo.group("policy")
        assert isinstance(policy, SGLangGenerator)
        assert policy.server_urls[1] == ext_url and policy.server_processes[1] is None
        assert sorted(kw["log_dir"].name for kw in launched) == ["judge", "policy"]
        assert {kw["weight_version"] for kw in launched} == {3}
        assert _calls(ext_log) == [
            ("/update_weight_version", {"new_version": "3", "abort_all_requests": False})
        ]
        asyncio.run(
            topo.update_weights(
                WeightUpdate(version=4, base_version=None, transport="disk_full"),
                _DiskTransport(),  # type: ignore[arg-type]
            )
        )
        assert topo.weight_version == 4 and topo.group("judge").weight_version == 3
        launched_logs = {Path(kw["log_dir"]).name: kw for kw in launched}
        policy_log = tmp_path / f"policy-{launched_logs['policy']['port']}.jsonl"
        judge_log = tmp_path / f"judge-{launched_logs['judge']['port']}.jsonl"
        for log in (policy_log, ext_log):
            (path, body) = _calls(log)[-1]
            assert path == "/update_weights_from_disk" and body["weight_version"] == "4"
        assert not any(p == "/update_weights_from_disk" for p, _ in _calls(judge_log))
        procs = [p for g in topo.groups.values() for p in g.server_processes if p is not None]
        asyncio.run(topo.close())
        assert not any(p.alive() for p in procs)
        assert external.alive()  # external engines are never stopped
    finally:
        external.stop()


class TestTopologyConformance(GeneratorConformance):
    """The topology passes the standard Generator suite: two policy groups and a judge, each a
    :class:`FakeGenerator` on the same table (the suite's updates reach both policy groups)."""

    @pytest.fixture
    def generator(self) -> Any:
        groups = [
            {"name": "judge", "serves_policy": False, "model_path": "/models/judge"},
            {"name": "a"},
            {"name": "b", "server_urls": ["http://10.0.0.5:30000"]},
        ]
        topo = SGLangTopology(
            _cfg(groups),
            make_group=lambda _: FakeGenerator(FakeGenerator.Config(step_delay_s=2e-4)),
        )
        yield topo
        asyncio.run(topo.close())

    def new_weights(self, generator: Any, seed: int) -> dict[str, torch.Tensor]:
        table = generator.group("a").table
        return {
            "table": table
            + torch.randn(table.shape, generator=torch.Generator().manual_seed(seed)) * 3
        }

    def teacher_forced_logprobs(self, generator: Any, input_ids, output_ids, temperature):  # type: ignore[no-untyped-def]
        a, b = generator.group("a"), generator.group("b")
        assert torch.equal(a.table, b.table)  # every policy group serves the same weights
        assert generator.group("judge").weight_version == 0
        return a.teacher_forced_logprobs(input_ids, output_ids, temperature)
