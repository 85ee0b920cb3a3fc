"""The Tinker REST API (``/api/v1/...``) as the official ``tinker`` SDK speaks it, on aiohttp.

Requests that do work (create_model, forward_backward, optim_step, save/load weights, sample)
answer at once with a future id; the work runs on one compute thread and the SDK polls
``/api/v1/retrieve_future`` (held open up to ``future_poll_s``) for the result. Operations of one
training client run in the order of their ``seq_id`` (the SDK numbers them in submission order,
and may send chunks of one ``forward_backward`` concurrently). Wire formats are the SDK's own:
its pydantic models for JSON bodies and its protobuf messages for ``forward_backward`` requests
and for ``forward_backward`` / ``sample`` results.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rl_core.errors import CheckpointError, ConfigError, RLError
from rl_tinker.backend import BaseModel, DatumInput, LoraSpec, Tenant
from rl_tinker.config import ServiceConfig
from rl_tinker.errors import UserError

__all__ = ["TinkerService"]

log = logging.getLogger("rl_tinker")

_PROTO = "application/x-protobuf"


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(eq=False)
class _Future:
    request_id: str
    kind: str
    model_id: str | None
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    finished: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    body: bytes | None = None
    content_type: str = "application/json"
    error: str | None = None
    category: str = "user"


@dataclass(eq=False)
class _Model:
    tenant: Tenant
    session_id: str
    next_seq: int = 1
    waiting: dict[int, tuple[_Future, Callable[[], Any]]] = field(default_factory=dict)
    in_flight: int = 0


@dataclass(eq=False)
class _Sampler:
    sampler_id: str
    base: str
    model_path: str | None


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class TinkerService:
    """The service: base models, tenants, futures, checkpoints and the aiohttp app.

    Args:
        config: its settings.
    """

    def __init__(self, config: ServiceConfig) -> None:
        if not config.models:
            raise ConfigError("models: name at least one base model (name: local directory).")
        self.config = config
        """Its settings."""
        self.state_dir = Path(config.state_dir).expanduser()
        """Root of every checkpoint."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._bases: dict[str, BaseModel] = {}
        self._models: dict[str, _Model] = {}
        self._sessions: dict[str, dict[str, Any]] = {}
        self._samplers: dict[str, _Sampler] = {}
        self._futures: dict[str, _Future] = {}
        self._sampler_weights: dict[str, tuple[str, LoraSpec, dict[str, Any]]] = {}
        self._queue: collections.deque[tuple[Callable[[], None], Callable[[], Any], str | None]] = (
            collections.deque()
        )
        self._cond = threading.Condition()
        self._closing = False
        self._worker = threading.Thread(
            target=self._work_loop, name="rl-tinker-compute", daemon=True
        )
        self._worker.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.metrics: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        """Per ``<model or sampler>/<operation>``: count, queue_s, compute_s, tokens."""

    # plumbing ---------------------------------------------------------------------------------

    def base(self, name: str) -> BaseModel:
        """The loaded base model ``name`` (loaded on first use).

        Raises:
            _HTTPError: 400 for a model the service does not serve.
        """
        key = name.split(":")[0]
        if key not in self.config.models:  # the model's directory names it too (the cookbook
            # uses one name for the tokenizer and the base model)
            by_path = {
                str(Path(p).expanduser().resolve()): k for k, p in self.config.models.items()
            }
            key = by_path.get(str(Path(name).expanduser().resolve()), key)
        if key not in self.config.models:
            raise _HTTPError(
                400,
                f"base_model {name!r} is not served here; get_server_capabilities lists "
                f"{sorted(self.config.models)}.",
            )
        if key not in self._bases:
            self._bases[key] = BaseModel(
                key,
                Path(self.config.models[key]).expanduser(),
                device=self.config.device,
                max_sampler_slots=self.config.max_sampler_slots,
                sampler=self.config.sampler,
                sampler_options=self.config.sglang,
                adapter_dir=Path(self.config.state_dir).expanduser() / "sglang-adapters" / key,
            )
        return self._bases[key]

    def _new_future(self, kind: str, model_id: str | None) -> _Future:
        fut = _Future(request_id=str(uuid.uuid4()), kind=kind, model_id=model_id)
        self._futures[fut.request_id] = fut
        return fut

    def _run(
        self, fut: _Future, work: Callable[[], Any], on_done: Callable[[], None] | None = None
    ) -> None:
        """Submit ``work`` to the compute thread; its result (bytes for protobuf, else a JSON
        dict) completes ``fut``."""
        loop = self._loop
        assert loop is not None

        def job() -> None:
            fut.started = time.perf_counter()
            body: bytes | None
            ctype = "application/json"
            error = None
            category = "user"
            try:
                result = work()
                if isinstance(result, bytes):
                    body, ctype = result, _PROTO
                else:
                    body = json.dumps(result).encode()
            except (UserError, CheckpointError, ConfigError, _HTTPError) as e:
                body, error = None, str(e)
            except Exception as e:  # a bug or a backend failure: reported, the service lives on
                log.exception("rl-tinker: %s %s failed", fut.kind, fut.request_id)
                body, error, category = None, f"{type(e).__name__}: {e}", "server"
            fut.finished = time.perf_counter()

            def finish() -> None:
                fut.body, fut.content_type, fut.error, fut.category = body, ctype, error, category
                fut.done.set()
                key = f"{fut.model_id or '-'}/{fut.kind}"
                m = self.metrics[key]
                m["count"] += 1
                m["queue_s"] += fut.started - fut.submitted
                m["compute_s"] += fut.finished - fut.started
                if on_done is not None:
                    on_done()

            loop.call_soon_threadsafe(finish)

        with self._cond:
            self._queue.append((job, work, fut.model_id))
            self._cond.notify()

    def _work_loop(self) -> None:
        """The compute thread: operations in queue order; with ``batch_tenants`` the first
        queued forward/forward_backward of up to ``max_batch_tenants`` tenants of one base run
        as one multi-LoRA batch (a tenant's later operations never overtake its earlier ones)."""
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                first = self._queue.popleft()
                group = [first]
                batch = getattr(first[1], "batch", None)
                if self.config.batch_tenants and batch is not None:
                    seen = {first[2]}
                    for item in list(self._queue):
                        if len(group) >= self.config.max_batch_tenants:
                            break
                        if item[2] in seen:
                            continue
                        seen.add(item[2])
                        other = getattr(item[1], "batch", None)
                        if (
                            other is not None
                            and other[0].tenant.base is batch[0].tenant.base
                            and other[4] == batch[4]
                        ):
                            group.append(item)
                            self._queue.remove(item)
            if len(group) > 1:
                items = [
                    (w.batch[0].tenant, w.batch[1], w.batch[2], w.batch[3]) for _, w, _ in group
                ]
                t0 = time.perf_counter()
                try:
                    results = batch[0].tenant.base.forward_backward_many(items, backward=batch[4])
                except Exception:  # one request's bad input: each runs alone and fails alone
                    log.info("rl-tinker: batched operation failed; running its parts alone")
                else:
                    for (_, w, _), res in zip(group, results, strict=True):
                        w.precomputed = res
                    m = self.metrics["-/multi_lora_batch"]
                    m["count"] += 1
                    m["tenants"] += len(group)
                    m["compute_s"] += time.perf_counter() - t0
            for job, _, _ in group:
                job()

    def _ordered(
        self, model: _Model, seq_id: int | None, fut: _Future, work: Callable[[], Any]
    ) -> None:
        """Run ``work`` after every operation of ``model`` with a smaller ``seq_id``."""
        if model.in_flight + len(model.waiting) >= self.config.max_queued_per_model:
            del self._futures[fut.request_id]
            raise _HTTPError(
                400,
                f"model {model.tenant.model_id} has {self.config.max_queued_per_model} "
                "operations queued (service limit max_queued_per_model); wait for earlier "
                "futures before submitting more.",
            )
        if seq_id is None:
            seq_id = model.next_seq
        if seq_id < model.next_seq or seq_id in model.waiting:
            del self._futures[fut.request_id]
            raise _HTTPError(
                400, f"seq_id {seq_id} of model {model.tenant.model_id} was already used."
            )
        model.waiting[seq_id] = (fut, work)
        while model.next_seq in model.waiting:
            f, w = model.waiting.pop(model.next_seq)
            model.next_seq += 1
            model.in_flight += 1

            def done(m: _Model = model) -> None:
                m.in_flight -= 1

            self._run(f, w, done)

    def _model(self, model_id: str) -> _Model:
        model = self._models.get(model_id)
        if model is None:
            raise _HTTPError(
                404, f"model_id {model_id!r} is unknown (create a training client first)."
            )
        return model

    # checkpoint paths -------------------------------------------------------------------------

    def _ckpt_dir(self, path: str) -> Path:
        """Directory of a ``tinker://<model_id>/<weights|sampler_weights>/<name>`` path."""
        if not path.startswith("tinker://"):
            raise UserError(f"checkpoint path {path!r} must start with tinker://")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[2]:
            raise UserError(
                f"checkpoint path {path!r} must be tinker://<model_id>/weights/<name> or "
                "tinker://<model_id>/sampler_weights/<name>"
            )
        return self.state_dir / _safe(parts[0]) / parts[1] / _safe(parts[2])

    def _sampler_snapshot(self, path: str) -> tuple[str, LoraSpec, dict[str, Any]]:
        if path not in self._sampler_weights:
            from safetensors.torch import load_file

            directory = self._ckpt_dir(path)
            meta = BaseModel.read_meta(directory)
            tensors = load_file(str(directory / "adapter.safetensors"))
            self._sampler_weights[path] = (
                meta["base_model"],
                LoraSpec.from_json(meta["lora"]),
                tensors,
            )
        return self._sampler_weights[path]

    # handlers ---------------------------------------------------------------------------------

    async def _json(self, request: Any) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError as e:
            raise _HTTPError(400, f"request body is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise _HTTPError(400, "request body must be a JSON object")
        return data

    def _future_reply(self, fut: _Future) -> dict[str, Any]:
        return {"request_id": fut.request_id, "model_id": fut.model_id}

    async def h_capabilities(self, request: Any) -> Any:
        """GET /api/v1/get_server_capabilities: the configured base models."""
        models = []
        for name, path in self.config.models.items():
            ctx = None
            with contextlib.suppress(Exception):
                ctx = json.loads((Path(path).expanduser() / "config.json").read_text()).get(
                    "max_position_embeddings"
                )
            models.append(
                {
                    "model_name": name,
                    "max_context_length": ctx,
                    "trainable": True,
                    "sampleable": True,
                }
            )
        return {"supported_models": models}

    async def h_client_config(self, request: Any) -> Any:
        """POST /api/v1/client/config: the SDK's feature flags (API-key auth, JSON/proto as served here)."""
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    async def h_dynamic_config(self, request: Any) -> Any:
        """POST /api/v1/client/dynamic_config: refreshed flags (sample cancellation off)."""
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    async def h_create_session(self, request: Any) -> Any:
        """POST /api/v1/create_session: a new session id."""
        body = await self._json(request)
        sid = f"s{uuid.uuid4().hex[:12]}"
        self._sessions[sid] = {"tags": body.get("tags", []), "models": 0}
        return {"type": "create_session", "session_id": sid}

    async def h_heartbeat(self, request: Any) -> Any:
        """POST /api/v1/session_heartbeat: accepted (sessions do not expire)."""
        return {"type": "session_heartbeat"}

    async def h_finish_session(self, request: Any) -> Any:
        """The SDK closing a session: its training clients are dropped (adapters and optimizer
        state freed after their queued operations; saved checkpoints stay on disk)."""
        sid = request.match_info["session_id"]
        gone = [m for m in self._models.values() if m.session_id == sid]
        for model in gone:
            del self._models[model.tenant.model_id]
            fut = self._new_future("drop_model", model.tenant.model_id)

            def drop(m: _Model = model) -> dict[str, Any]:
                m.tenant.base.drop_tenant(m.tenant)
                return {}

            self._run(fut, drop)
            del self._futures[fut.request_id]
        self._sessions.pop(sid, None)
        return {}

    async def h_telemetry(self, request: Any) -> Any:
        """POST /api/v1/telemetry: accepted and dropped (nothing leaves the machine)."""
        return {"status": "accepted"}

    async def h_health(self, request: Any) -> Any:
        """GET /api/v1/healthz."""
        return {"status": "ok"}

    def _add_model(
        self, session_id: str, model_seq_id: int, base_model: str, lora: LoraSpec
    ) -> tuple[str, _Model]:
        session = self._sessions.get(session_id)
        if session is None:
            raise _HTTPError(404, f"session {session_id!r} is unknown (the service restarted?).")
        if session["models"] >= self.config.max_models_per_session:
            raise _HTTPError(
                400,
                f"session {session_id} already holds {self.config.max_models_per_session} "
                "training clients (service limit max_models_per_session).",
            )
        if len(self._models) >= self.config.max_models:
            raise _HTTPError(
                400,
                f"the service holds {self.config.max_models} training clients (limit max_models).",
            )
        if lora.rank < 1 or lora.rank > 256:
            raise _HTTPError(400, f"lora rank must lie in [1, 256], got {lora.rank}.")
        base = self.base(base_model)
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self._models:
            raise _HTTPError(400, f"model {model_id} exists already.")
        session["models"] += 1
        tenant = Tenant(model_id=model_id, base=base, adapter="", lora=lora)
        model = _Model(tenant=tenant, session_id=session_id)
        self._models[model_id] = model
        return model_id, model

    async def h_create_model(self, request: Any) -> Any:
        """POST /api/v1/create_model: a new LoRA training client (a future of its model id)."""
        body = await self._json(request)
        cfg = body.get("lora_config") or {}
        lora = LoraSpec(
            rank=int(cfg.get("rank", 32)),
            seed=int(cfg.get("seed") or 0),
            train_attn=bool(cfg.get("train_attn", True)),
            train_mlp=bool(cfg.get("train_mlp", True)),
            train_unembed=bool(cfg.get("train_unembed", True)),
        )
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise _HTTPError(400, f"optimizer_config.type {opt!r}: only adamw is supported.")
        model_id, model = self._add_model(
            body["session_id"], int(body["model_seq_id"]), body["base_model"], lora
        )
        fut = self._new_future("create_model", model_id)
        base = model.tenant.base

        def work() -> dict[str, Any]:
            tenant = base.new_tenant(model_id, lora)
            model.tenant = tenant
            return {"model_id": model_id, "type": "create_model"}

        model.next_seq = 1
        model.in_flight += 1

        def done() -> None:
            model.in_flight -= 1

        self._run(fut, work, done)
        return self._future_reply(fut)

    async def h_get_info(self, request: Any) -> Any:
        """POST /api/v1/get_info: base model, tokenizer directory and LoRA rank of a client."""
        body = await self._json(request)
        model = self._model(body["model_id"])
        t = model.tenant
        return {
            "type": "get_info",
            "model_id": t.model_id,
            "model_data": {
                "arch": None,
                "model_name": t.base.name,
                "tokenizer_id": str(t.base.path),
            },
            "is_lora": True,
            "lora_rank": t.lora.rank,
            "model_name": t.base.name,
        }

    async def h_forward_backward(self, request: Any) -> Any:
        """POST /api/v1/forward_backward (protobuf body): forward, or forward and backward, as a future."""
        from tinker.proto import tinker_public_pb2 as pb

        raw = await request.read()
        if request.headers.get("Content-Encoding") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        msg = pb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(raw)
        except Exception as e:
            raise _HTTPError(
                400, f"forward_backward body is not a ForwardBackwardRequest: {e}"
            ) from e
        model = self._model(msg.model_id)
        data = [_decode_datum(d, i) for i, d in enumerate(msg.data)]
        config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
        for k, v in msg.loss_fn_config_v2.items():
            if v.WhichOneof("value") == "number":
                config[k] = float(v.number)
        loss_fn = msg.loss_fn or "cross_entropy"
        backward = not msg.forward_only
        kind = "forward_backward" if backward else "forward"
        fut = self._new_future(kind, msg.model_id)

        def work() -> bytes:
            t = model.tenant
            if hasattr(work, "precomputed"):  # ran in a multi-tenant batch
                outputs, metrics = work.precomputed
            else:
                outputs, metrics = t.base.forward_backward(
                    t, data, loss_fn, config, backward=backward
                )
            m = self.metrics[f"{msg.model_id}/{kind}"]
            m["tokens"] += metrics["tokens:sum"]
            return _encode_fwdbwd(outputs, metrics)

        work.batch = (model, data, loss_fn, config, backward)  # type: ignore[attr-defined]
        self._ordered(model, msg.seq_id or None, fut, work)
        return self._future_reply(fut)

    async def h_optim_step(self, request: Any) -> Any:
        """POST /api/v1/optim_step: one AdamW step with the request's AdamParams, as a future."""
        body = await self._json(request)
        model = self._model(body["model_id"])
        adam = body.get("adam_params") or body.get("optim_params")
        if adam is None:
            raise _HTTPError(
                400, "optim_step: only AdamParams are supported (adam_params missing)."
            )
        fut = self._new_future("optim_step", body["model_id"])

        def work() -> dict[str, Any]:
            t = model.tenant
            return {"metrics": t.base.optim_step(t, adam)}

        self._ordered(model, body.get("seq_id"), fut, work)
        return self._future_reply(fut)

    async def h_save_weights(self, request: Any) -> Any:
        """POST /api/v1/save_weights (save_state): adapter + optimizer to tinker://<model>/weights/<name>."""
        body = await self._json(request)
        model = self._model(body["model_id"])
        name = body.get("path") or f"step-{uuid.uuid4().hex[:8]}"
        path = f"tinker://{body['model_id']}/weights/{name}"
        fut = self._new_future("save_weights", body["model_id"])

        def work() -> dict[str, Any]:
            directory = self._ckpt_dir(path)
            if directory.exists() and not body.get("overwrite", False):
                raise UserError(f"checkpoint {path} exists; pick another name or overwrite=True.")
            model.tenant.base.save(model.tenant, directory, with_optimizer=True)
            return {"path": path, "type": "save_weights"}

        self._ordered(model, body.get("seq_id"), fut, work)
        return self._future_reply(fut)

    async def h_save_for_sampler(self, request: Any) -> Any:
        """POST /api/v1/save_weights_for_sampler: an adapter snapshot for sampling (named, or a new sampling session)."""
        body = await self._json(request)
        model_id = body["model_id"]
        model = self._model(model_id)
        name = body.get("path") or f"sampler-{uuid.uuid4().hex[:8]}"
        path = f"tinker://{model_id}/sampler_weights/{name}"
        seq = body.get("sampling_session_seq_id")
        sampler_id = None
        if body.get("path") is None and seq is not None:
            sampler_id = f"{model.session_id}:sample:{seq}"
            self._samplers[sampler_id] = _Sampler(sampler_id, model.tenant.base.name, path)
        fut = self._new_future("save_weights_for_sampler", model_id)

        def work() -> dict[str, Any]:
            t = model.tenant
            directory = self._ckpt_dir(path)
            t.base.save(t, directory, with_optimizer=False)
            self._sampler_weights[path] = (t.base.name, t.lora, t.state_tensors())
            return {
                "path": path,
                "sampling_session_id": sampler_id,
                "type": "save_weights_for_sampler",
            }

        self._ordered(model, body.get("seq_id"), fut, work)
        return self._future_reply(fut)

    async def h_load_weights(self, request: Any) -> Any:
        """POST /api/v1/load_weights: load a checkpoint into a client, or create a client from it."""
        body = await self._json(request)
        path = body["path"]
        with_opt = bool(body.get("optimizer", False))
        try:
            directory = self._ckpt_dir(path)
            meta = BaseModel.read_meta(directory)
        except (UserError, CheckpointError) as e:
            raise _HTTPError(400, str(e)) from e
        if body.get("session_id") is not None:  # create-via-load: the model's first request
            lora = LoraSpec.from_json(meta["lora"])
            model_id, model = self._add_model(
                body["session_id"],
                int(body["model_seq_id"]),
                body.get("base_model") or meta["base_model"],
                lora,
            )
            fut = self._new_future("load_weights", model_id)
            base = model.tenant.base

            def create_and_load() -> dict[str, Any]:
                tenant = base.new_tenant(model_id, lora)
                model.tenant = tenant
                base.load(tenant, directory, with_optimizer=with_opt)
                return {"path": path, "model_id": model_id, "type": "load_weights"}

            model.next_seq = 1
            model.in_flight += 1

            def done() -> None:
                model.in_flight -= 1

            self._run(fut, create_and_load, done)
            return self._future_reply(fut)
        model_id = body["model_id"]
        model = self._model(model_id)
        fut = self._new_future("load_weights", model_id)

        def work() -> dict[str, Any]:
            model.tenant.base.load(model.tenant, directory, with_optimizer=with_opt)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        self._ordered(model, body.get("seq_id"), fut, work)
        return self._future_reply(fut)

    async def h_create_sampling_session(self, request: Any) -> Any:
        """POST /api/v1/create_sampling_session: a sampler on a snapshot path or the base model."""
        body = await self._json(request)
        sid = body["session_id"]
        sampler_id = f"{sid}:sample:{body['sampling_session_seq_id']}"
        path = body.get("model_path")
        if path:
            try:
                base_name = self._sampler_snapshot(path)[0]
            except (UserError, CheckpointError) as e:
                raise _HTTPError(400, str(e)) from e
        else:
            base_name = body.get("base_model") or ""
            self.base(base_name)
        self._samplers[sampler_id] = _Sampler(sampler_id, base_name.split(":")[0], path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    async def h_get_sampler(self, request: Any) -> Any:
        """GET /api/v1/samplers/{id}: a sampler's base model and snapshot path."""
        sampler = self._samplers.get(request.match_info["sampler_id"])
        if sampler is None:
            raise _HTTPError(404, "unknown sampler")
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": sampler.base,
            "model_path": sampler.model_path,
        }

    async def h_sample(self, request: Any) -> Any:
        """POST /api/v1/asample: a sampling request (n samples, prompt log-probs), as a future."""
        body = await self._json(request)
        if body.get("sampling_session_id"):
            sampler = self._samplers.get(body["sampling_session_id"])
            if sampler is None:
                raise _HTTPError(
                    404, f"sampling session {body['sampling_session_id']!r} is unknown."
                )
            base_name, path = sampler.base, sampler.model_path
        else:
            path = body.get("model_path")
            base_name = body.get("base_model") or (self._sampler_snapshot(path)[0] if path else "")
        base = self.base(base_name)
        weights = None
        if path:
            try:
                _, lora, tensors = self._sampler_snapshot(path)
            except (UserError, CheckpointError) as e:
                raise _HTTPError(400, str(e)) from e
            weights = (path, lora, tensors)
        prompt = np.asarray(
            [t for c in body["prompt"]["chunks"] for t in _chunk_tokens(c)], dtype=np.int64
        )
        params = body.get("sampling_params") or {}
        n = int(body.get("num_samples", 1))
        if n < 1 or n > 256:
            raise _HTTPError(400, f"num_samples must lie in [1, 256], got {n}.")
        max_tokens = params.get("max_tokens")
        max_tokens = self.config.max_sample_tokens if max_tokens is None else int(max_tokens)
        if max_tokens > self.config.max_sample_tokens:
            raise _HTTPError(
                400,
                f"max_tokens {max_tokens} exceeds the service cap {self.config.max_sample_tokens}.",
            )
        key = path or base_name
        fut = self._new_future("sample", key)

        def work() -> bytes:
            res = base.sample(
                prompt,
                weights=weights,
                num_samples=n,
                max_tokens=max_tokens,
                temperature=float(params.get("temperature", 1.0)),
                top_k=int(params.get("top_k", -1)),
                top_p=float(params.get("top_p", 1.0)),
                stop=params.get("stop"),
                seed=params.get("seed"),
                prompt_logprobs=bool(body.get("prompt_logprobs")),
            )
            self.metrics[f"{key}/sample"]["tokens"] += sum(len(s[0]) for s in res.sequences)
            return _encode_sample(res)

        self._run(fut, work)
        reply = self._future_reply(fut)
        reply["sample_sequence_ids"] = [f"{fut.request_id}:{i}" for i in range(n)]
        return reply

    async def h_retrieve_future(self, request: Any) -> Any:
        """POST /api/v1/retrieve_future: a future's result, held up to future_poll_s, else try-again."""
        from aiohttp import web

        body = await self._json(request)
        fut = self._futures.get(body.get("request_id", ""))
        if fut is None:
            raise _HTTPError(404, f"future {body.get('request_id')!r} is unknown.")
        if not fut.done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut.done.wait(), self.config.future_poll_s)
        if not fut.done.is_set():
            return {"type": "try_again", "request_id": fut.request_id, "queue_state": "active"}
        if fut.error is not None:
            return {"error": fut.error, "category": fut.category}
        return web.Response(body=fut.body, content_type=fut.content_type)

    async def h_metrics(self, request: Any) -> Any:
        """GET /api/v1/metrics: per model/operation counts, queue and compute seconds, tokens."""
        return {k: dict(v) for k, v in self.metrics.items()}

    # app --------------------------------------------------------------------------------------

    def app(self) -> Any:
        """The aiohttp application (routes under ``/api/v1``)."""
        from aiohttp import web

        routes: list[tuple[str, str, Callable[[Any], Any]]] = [
            ("GET", "get_server_capabilities", self.h_capabilities),
            ("GET", "healthz", self.h_health),
            ("POST", "client/config", self.h_client_config),
            ("POST", "client/dynamic_config", self.h_dynamic_config),
            ("POST", "create_session", self.h_create_session),
            ("POST", "session_heartbeat", self.h_heartbeat),
            ("POST", "telemetry", self.h_telemetry),
            ("POST", "create_model", self.h_create_model),
            ("POST", "get_info", self.h_get_info),
            ("POST", "forward_backward", self.h_forward_backward),
            ("POST", "optim_step", self.h_optim_step),
            ("POST", "save_weights", self.h_save_weights),
            ("POST", "save_weights_for_sampler", self.h_save_for_sampler),
            ("POST", "load_weights", self.h_load_weights),
            ("POST", "create_sampling_session", self.h_create_sampling_session),
            ("GET", "samplers/{sampler_id}", self.h_get_sampler),
            ("POST", "asample", self.h_sample),
            ("POST", "retrieve_future", self.h_retrieve_future),
            ("POST", "sessions/{session_id}/finish", self.h_finish_session),
            ("GET", "metrics", self.h_metrics),
        ]
        app = web.Application(client_max_size=256 * 1024**2, middlewares=[self._middleware])
        for method, path, handler in routes:
            app.router.add_route(method, f"/api/v1/{path}", handler)
        app.router.add_route("*", "/{tail:.*}", self.h_unsupported)
        return app

    async def h_unsupported(self, request: Any) -> Any:
        """Any other route: 404 naming the endpoint (docs/service.md lists what is served)."""
        log.warning("rl-tinker: unsupported endpoint %s %s", request.method, request.path)
        raise _HTTPError(404, f"{request.method} {request.path} is not served by rl-tinker.")

    @property
    def _middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def middleware(request: Any, handler: Any) -> Any:
            self._loop = asyncio.get_running_loop()
            if self.config.api_key and request.headers.get("X-API-Key") != self.config.api_key:
                return web.json_response({"error": "bad or missing X-API-Key"}, status=401)
            try:
                out = await handler(request)
            except _HTTPError as e:
                return web.json_response({"error": e.message, "detail": e.message}, status=e.status)
            except (KeyError, TypeError, ValueError, RLError) as e:
                return web.json_response(
                    {"error": f"bad request: {e!r}", "detail": f"bad request: {e!r}"}, status=400
                )
            if isinstance(out, web.StreamResponse):
                return out
            return web.json_response(out)

        return middleware

    def close(self) -> None:
        """Stop the compute thread (after the running operation)."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify()
        self._worker.join(timeout=120)
        for base in self._bases.values():
            base.close()


def _chunk_tokens(chunk: dict[str, Any]) -> list[int]:
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise _HTTPError(
            400, f"model_input chunk type {chunk.get('type')!r}: only encoded_text is supported."
        )
    return [int(t) for t in chunk["tokens"]]


def _decode_datum(d: Any, i: int) -> DatumInput:
    from tinker.proto import tinker_public_pb2 as pb

    tokens: list[np.ndarray] = []
    for c in d.model_input:
        if c.WhichOneof("chunk") != "encoded_text":
            raise _HTTPError(400, f"datum {i}: only encoded_text model_input chunks are supported.")
        tokens.append(np.frombuffer(c.encoded_text.tokens, dtype=np.int32).astype(np.int64))
    inputs = {}
    for name, t in d.loss_fn_inputs.items():
        dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}.get(t.dtype)
        if dtype is None:
            raise _HTTPError(
                400,
                f"datum {i}: loss_fn_inputs[{name!r}] has dtype {t.dtype}; use float32 or int64.",
            )
        if t.HasField("sparse_csr"):
            raise _HTTPError(400, f"datum {i}: sparse loss_fn_inputs are not supported.")
        arr = np.frombuffer(t.dense, dtype=dtype).copy()
        inputs[name] = arr.reshape(list(t.shape)) if len(t.shape) else arr
    return DatumInput(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int64), inputs=inputs
    )


def _encode_fwdbwd(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    rec = msg.loss_fn_outputs.add()
    rec.num_datums = len(outputs)
    names = sorted(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = rec.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def _encode_sample(res: Any) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.SampleResponse()
    for tokens, logprobs, reason in res.sequences:
        seq = msg.sequences.add()
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        seq.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
    if res.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(res.prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
