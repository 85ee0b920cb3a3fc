"""Conformance suite for :class:`~rl_core.interfaces.Generator`, a fake generator and an
in-memory weight transport.

Subclass the suite in your generator's tests and provide a generator serving a small model at
weight version 0, plus new weights for the update tests::

    class TestMyGenerator(GeneratorConformance):
        @pytest.fixture
        def generator(self, tmp_path):
            gen = MyGenerator(MyGenerator.Config(model_path=build_tiny_model(tmp_path / "m")))
            yield gen
            asyncio.run(gen.close())

        def new_weights(self, generator, seed):
            return [(name, t + 0.5 * torch.randn_like(t)) for name, t in my_weights(generator)]

Optional hooks: :meth:`GeneratorConformance.teacher_forced_logprobs` (the log-softmax of the
served model on a given continuation; enables the exact log-prob tests), the ``transport``
fixture (default :class:`InMemoryTransport`; an engine that only takes updates from disk returns
its own) and :meth:`GeneratorConformance.failing_update`. Capabilities are flags on the suite: ``supports_abort`` follows the generator class,
``seed_batch_invariant`` says a seeded request samples the same tokens in any batch.

Tests call ``asyncio.run`` themselves (no pytest-asyncio needed); one test may run several event
loops one after the other, so a generator must not bind to the loop it was first used on.

:class:`FakeGenerator` (a bigram table, pure torch) passes the suite and serves as a fast stand-in
for other components' tests; it and :class:`InMemoryTransport` live in
:mod:`rl_core.testing.fake_generator` and are re-exported here.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch

from rl_core.errors import WeightSyncError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.logprobs import truncate_logits
from rl_core.testing._base import ConformanceSuite
from rl_core.testing.fake_generator import FakeGenerator, InMemoryTransport
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    WeightUpdate,
)

__all__ = [
    "FakeGenerator",
    "GeneratorConformance",
    "InMemoryTransport",
    "causal_lm_logprobs",
    "perturbed_weights",
]


def perturbed_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor plus seeded Gaussian noise of its own scale (its standard deviation, at least
    0.05): weights that differ from the served ones, a ready :meth:`GeneratorConformance.new_weights`
    for generators serving a real model."""
    g = torch.Generator().manual_seed(seed)
    for name, t in named_tensors:
        scale = max(float(t.float().std()) if t.numel() > 1 else 0.0, 0.05)
        yield name, t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)


def causal_lm_logprobs(
    model: Any,
    input_ids: Sequence[int],
    output_ids: Sequence[int],
    temperature: float,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """``[R, V]`` log-probs of the distribution each of ``output_ids`` was sampled from, by a
    causal LM (called as ``model(input_ids=[1, L]).logits``) run on the whole sequence: the
    ``temperature``-scaled softmax (``T = 1`` when 0) renormalised over the top-k / top-p set.
    On the CPU. A ready :meth:`GeneratorConformance.teacher_forced_logprobs` for generators
    serving a Hugging Face model."""
    device = getattr(model, "device", torch.device("cpu"))
    ids = torch.tensor([list(input_ids) + list(output_ids)], device=device)
    with torch.no_grad():
        logits_LV = model(input_ids=ids).logits[0].float().cpu()
    t = temperature if temperature > 0 else 1.0
    p = len(input_ids)
    z_RV = logits_LV[p - 1 : p - 1 + len(output_ids)] / t
    return torch.log_softmax(truncate_logits(z_RV, top_p=top_p, top_k=top_k), -1)


# ----------------------------------------------------------------------------------------------
# The suite
# ----------------------------------------------------------------------------------------------


class _BrokenTransport(WeightTransport):
    """Yields the first tensor of a real update, then raises WeightSyncError (a truncated stream)."""

    name: ClassVar[str] = "broken"

    def __init__(self, inner: WeightTransport) -> None:
        self.inner = inner

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        return self.inner.publish(version, named_tensors, metadata=metadata)

    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        it = self.inner.receive(update, current_version=current_version)

        def gen() -> Iterator[tuple[str, torch.Tensor]]:
            yield next(it)
            raise WeightSyncError(
                f"broken transport: payload of version {update.version} truncated after one tensor"
            )

        return gen()


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _req(rid: str, ids: Sequence[int], **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, input_ids=tuple(ids), sampling=SamplingParams(**sampling)
    )


class GeneratorConformance(ConformanceSuite):
    """Standard tests every :class:`~rl_core.interfaces.Generator` must pass.

    Provide the ``generator`` fixture (weight version 0, a small model) and :meth:`new_weights`.
    Optional: :meth:`teacher_forced_logprobs`, :meth:`failing_update`, the ``transport``,
    ``vocab_size`` and ``default_stop_ids`` fixtures (the latter two default to the generator's
    attributes of the same names).
    """

    __test__ = False

    seed_batch_invariant: ClassVar[bool] = True
    """A seeded request samples the same tokens alone and inside a larger batch."""
    logprob_atol: ClassVar[float] = 1e-4
    """Tolerance of the log-prob comparisons with :meth:`teacher_forced_logprobs`."""
    abort_max_new_tokens: ClassVar[int] = 2048
    """``max_new_tokens`` of the requests the abort tests cut short (must outlast the delay)."""
    abort_delay_s: ClassVar[float] = 0.2
    """How long the abort tests let requests run before aborting."""

    # -- fixtures and hooks ---------------------------------------------------------------------

    @pytest.fixture
    def generator(self) -> Generator:
        """A generator on a small model at weight version 0; override in your subclass."""
        raise NotImplementedError("override the `generator` fixture in your conformance subclass")

    @pytest.fixture
    def transport(self) -> WeightTransport:
        """Transport the update tests publish through; default :class:`InMemoryTransport`."""
        return InMemoryTransport()

    @pytest.fixture
    def vocab_size(self, generator: Generator) -> int:
        """Number of token ids the served model can sample; default ``generator.vocab_size``."""
        v = getattr(generator, "vocab_size", None)
        if v is None:
            raise NotImplementedError("override the `vocab_size` fixture (generator has none)")
        return int(v)

    @pytest.fixture
    def default_stop_ids(self, generator: Generator) -> tuple[int, ...]:
        """Stop ids the engine adds to every request (EOS); default ``generator.default_stop_ids``."""
        return tuple(getattr(generator, "default_stop_ids", ()))

    @pytest.fixture
    def prompts(self, vocab_size: int) -> list[tuple[int, ...]]:
        """Prompts of different lengths (ids below ``vocab_size``)."""
        v = min(vocab_size, 256)
        return [tuple((7 * i + 3 * j + 1) % v for j in range(2 + 3 * i)) for i in range(4)]

    def new_weights(
        self, generator: Generator, seed: int
    ) -> Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]:
        """Hugging Face-named weights (pairs or a dict), different from the served ones, that change greedy outputs
        on :meth:`prompts` (e.g. every tensor plus noise of its own scale); override."""
        raise NotImplementedError("override new_weights() in your conformance subclass")

    def failing_update(
        self, generator: Generator, transport: WeightTransport, version: int
    ) -> tuple[WeightUpdate, WeightTransport]:
        """An update of ``version`` whose application raises WeightSyncError part-way.

        Default: new weights published through ``transport``, handed over by a wrapper whose
        stream breaks after the first tensor. Engines that read updates without calling
        ``transport.apply`` (e.g. a server loading from disk) override this with a damaged
        payload of their own.
        """
        broken = _BrokenTransport(transport)
        return broken.publish(version, self._weights(generator, version)), broken

    def teacher_forced_logprobs(
        self,
        generator: Generator,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        temperature: float,
    ) -> torch.Tensor:
        """``[R, V]`` ``log_softmax(logits / T)`` of the served model at the positions that
        predicted ``output_ids`` (``T = 1`` when ``temperature == 0``). Optional: without it the
        exact log-prob tests are skipped."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------------

    def _weights(self, generator: Generator, seed: int) -> list[tuple[str, torch.Tensor]]:
        w = self.new_weights(generator, seed)
        return list(w.items()) if isinstance(w, Mapping) else list(w)

    def _scored(self, generator: Generator, req: GenerationRequest, res: GenerationResult) -> Any:
        try:
            return self.teacher_forced_logprobs(
                generator, req.input_ids, res.output_ids, req.sampling.temperature
            )
        except NotImplementedError:
            pytest.skip("teacher_forced_logprobs() not provided")

    @staticmethod
    def _greedy(
        generator: Generator, prompts: Sequence[Sequence[int]], n: int = 12
    ) -> list[tuple[int, ...]]:
        reqs = [_req(f"g{i}", p, temperature=0.0, max_new_tokens=n) for i, p in enumerate(prompts)]
        return [r.output_ids for r in _run(generator.generate(reqs))]

    # -- tests ----------------------------------------------------------------------------------

    def test_results_in_request_order(self, generator: Generator, prompts: list) -> None:
        """One result per request, in request order, each with its request's id.

        Troubleshooting: engines that batch or reorder internally must map results back by
        ``request_id``; duplicate or missing results mean a lost request.
        """
        reqs = [
            _req(f"req-{9 - i}", prompts[i % len(prompts)], max_new_tokens=2 + i, seed=i)
            for i in range(10)
        ]
        res = _run(generator.generate(reqs))
        assert [r.request_id for r in res] == [q.request_id for q in reqs]
        assert _run(generator.generate([])) == []

    def test_lengths_and_logprobs_valid(
        self, generator: Generator, prompts: list, vocab_size: int
    ) -> None:
        """Every output has ``len <= max_new_tokens``, one finite log-prob ``<= 0`` per token and
        token ids inside the vocabulary.

        Troubleshooting: return the log-prob of each sampled token (not of the whole
        distribution); log-probs above 0 usually mean logits were returned instead.
        """
        reqs = [
            _req(f"r{i}", p, max_new_tokens=3 + 5 * i, seed=i, temperature=0.5 + 0.25 * i)
            for i, p in enumerate(prompts)
        ]
        for q, r in zip(reqs, _run(generator.generate(reqs))):
            assert 1 <= len(r.output_ids) <= q.sampling.max_new_tokens
            assert len(r.output_ids) == len(r.output_logprobs)
            assert all(0 <= t < vocab_size for t in r.output_ids)
            assert all(math.isfinite(x) and x <= 1e-6 for x in r.output_logprobs), r.output_logprobs

    def test_finish_reasons(
        self, generator: Generator, prompts: list, default_stop_ids: tuple[int, ...]
    ) -> None:
        """STOP iff the last token is a stop id (the request's or the engine's EOS), and no stop id
        appears earlier; otherwise LENGTH with exactly ``max_new_tokens`` tokens.

        Troubleshooting: include the stop token in ``output_ids``; stop at the first stop id;
        report LENGTH only when the limit was reached.
        """
        reqs = [
            _req(f"r{i}", prompts[i % len(prompts)], max_new_tokens=6, seed=100 + i)
            for i in range(12)
        ]
        reasons = []
        for q, r in zip(reqs, _run(generator.generate(reqs))):
            stops = set(q.sampling.stop_token_ids) | set(default_stop_ids)
            assert not stops & set(r.output_ids[:-1]), f"{r.request_id}: stop id before the end"
            if r.finish_reason == FinishReason.STOP:
                assert r.output_ids[-1] in stops
            else:
                assert r.finish_reason == FinishReason.LENGTH, r.finish_reason
                assert len(r.output_ids) == q.sampling.max_new_tokens
                assert r.output_ids[-1] not in stops
            reasons.append(r.finish_reason)
        assert FinishReason.LENGTH in reasons

    def test_every_token_a_stop_id(
        self, generator: Generator, prompts: list, vocab_size: int
    ) -> None:
        """With every token id a stop id, each response is exactly one token and ends with STOP.

        Troubleshooting: check the request's ``stop_token_ids`` on every sampled token, the first
        one included.
        """
        stop = tuple(range(vocab_size))
        reqs = [
            _req(f"r{i}", p, max_new_tokens=8, seed=i, stop_token_ids=stop)
            for i, p in enumerate(prompts)
        ]
        for r in _run(generator.generate(reqs)):
            assert len(r.output_ids) == 1 and r.finish_reason == FinishReason.STOP, r

    def test_stop_token_ids_honoured(self, generator: Generator, prompts: list) -> None:
        """Greedy output cut at the first occurrence of a chosen stop id equals the greedy output
        of the same request with that stop id, ending in STOP.

        Troubleshooting: a stop id must end the response right after it is sampled, be included
        in ``output_ids``, and not change the tokens before it.
        """
        free = self._greedy(generator, prompts, n=10)
        checked = 0
        for i, (p, out) in enumerate(zip(prompts, free)):
            if len(out) < 3:
                continue
            stop = out[2]
            cut = out[: out.index(stop) + 1]
            (r,) = _run(
                generator.generate(
                    [_req(f"s{i}", p, temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))]
                )
            )
            assert r.output_ids == cut and r.finish_reason == FinishReason.STOP, (out, r)
            checked += 1
        assert checked, "every greedy output ended within 2 tokens; use another model or prompts"

    def test_greedy_deterministic(
        self, generator: Generator, prompts: list, vocab_size: int
    ) -> None:
        """temperature 0 gives the same tokens and log-probs on every call, and each log-prob is
        at least ``-log(V)`` (the most likely token has probability ``>= 1/V``).

        Troubleshooting: greedy must be argmax of the logits, independent of seeds; its log-prob
        is the (temperature 1) log-softmax of that token.
        """
        reqs = [_req(f"r{i}", p, temperature=0.0, max_new_tokens=8) for i, p in enumerate(prompts)]
        a = _run(generator.generate(reqs))
        b = _run(generator.generate(list(reversed(reqs))))[::-1]
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
            assert torch.allclose(
                torch.tensor(x.output_logprobs),
                torch.tensor(y.output_logprobs),
                atol=self.logprob_atol,
            )
            assert all(v >= -math.log(vocab_size) - 1e-4 for v in x.output_logprobs)

    def test_logprobs_match_teacher_forcing(self, generator: Generator, prompts: list) -> None:
        """In one mixed batch (prompt lengths, greedy and sampled rows, temperatures, top-k/top-p),
        each log-prob equals ``log_softmax(logits / T)`` of a teacher-forced forward, before
        truncation, or, for a generator with ``truncated_logprobs``, renormalised over the
        request's top-k/top-p set (:func:`rl_core.logprobs.truncate_logits`); greedy rows pick
        the argmax.

        Troubleshooting: compute log-probs from the temperature-scaled logits *before* top-k/top-p
        masking (or after it, declaring ``truncated_logprobs = True``); use ``T = 1`` for greedy;
        with left padding, positions must count real tokens.
        """
        settings = [
            {"temperature": 0.0},
            {"temperature": 1.0},
            {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 1.3, "top_k": 5},
        ]
        reqs = [
            _req(f"r{i}", prompts[i % len(prompts)], max_new_tokens=10, seed=i, **settings[i % 4])
            for i in range(8)
        ]
        for q, r in zip(reqs, _run(generator.generate(reqs))):
            ref_RV = self._scored(generator, q, r).float()
            ids_R = torch.tensor(r.output_ids, dtype=torch.long)
            if type(generator).truncated_logprobs:
                z_RV = truncate_logits(
                    ref_RV, top_p=q.sampling.top_p, top_k=max(q.sampling.top_k, 0), keep_R=ids_R
                )
                ref_RV = torch.log_softmax(z_RV, dim=-1)
            want_R = ref_RV.gather(1, ids_R[:, None]).squeeze(1)
            got_R = torch.tensor(r.output_logprobs)
            torch.testing.assert_close(got_R, want_R, atol=self.logprob_atol, rtol=0)
            if q.sampling.temperature == 0:
                torch.testing.assert_close(
                    got_R, ref_RV.max(-1).values, atol=self.logprob_atol, rtol=0
                )
            if q.sampling.top_k > 0:
                kth_R = ref_RV.topk(q.sampling.top_k, -1).values[:, -1]
                assert bool((want_R >= kth_R - self.logprob_atol).all()), "sampled outside top-k"

    def test_seeded_sampling_reproducible(self, generator: Generator, prompts: list) -> None:
        """The same seeded requests give the same tokens twice; different seeds differ.

        Troubleshooting: derive all randomness of a request from ``sampling.seed`` (e.g. a
        ``torch.Generator`` per request), never from a global RNG.
        """
        reqs = [
            _req(f"r{i}", prompts[i % len(prompts)], max_new_tokens=16, seed=1000 + i)
            for i in range(6)
        ]
        a = _run(generator.generate(reqs))
        b = _run(generator.generate(reqs))
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
        other = [
            _req(f"o{i}", q.input_ids, max_new_tokens=16, seed=5000 + i) for i, q in enumerate(reqs)
        ]
        c = _run(generator.generate(other))
        assert [r.output_ids for r in a] != [r.output_ids for r in c]

    def test_seeded_sampling_batch_invariant(self, generator: Generator, prompts: list) -> None:
        """A seeded request samples the same tokens alone and inside a batch of other requests
        (only if ``seed_batch_invariant``).

        Troubleshooting: draw each row's randomness from its own generator, not from one batch
        tensor whose layout depends on the batch; or set ``seed_batch_invariant = False``.
        """
        if not self.seed_batch_invariant:
            pytest.skip("generator does not promise batch-invariant seeded sampling")
        target = _req("t", prompts[1], max_new_tokens=12, seed=77, temperature=0.9)
        (alone,) = _run(generator.generate([target]))
        others = [
            _req(f"o{i}", prompts[(i + 2) % len(prompts)], max_new_tokens=4 + i, seed=i)
            for i in range(5)
        ]
        mixed = _run(generator.generate([*others[:3], target, *others[3:]]))
        assert mixed[3].output_ids == alone.output_ids

    def test_weight_version_reported(self, generator: Generator, prompts: list) -> None:
        """A fresh generator is on version 0 and stamps it on every result; health() is True.

        Troubleshooting: report the version of the weights that produced the tokens, not the
        version of a pending update.
        """
        assert generator.weight_version == 0
        assert _run(generator.health()) is True
        res = _run(
            generator.generate([_req(f"r{i}", p, max_new_tokens=3) for i, p in enumerate(prompts)])
        )
        assert {r.weight_version for r in res} == {0}

    def test_weight_update_changes_outputs_and_version(
        self, generator: Generator, prompts: list, transport: WeightTransport
    ) -> None:
        """After ``update_weights`` with new weights the version is the update's and greedy
        outputs change; results carry the new version.

        Troubleshooting: load the tensors into the weights actually used for sampling (tied
        embeddings included) and only then set the version.
        """
        before = self._greedy(generator, prompts)
        update = transport.publish(1, self._weights(generator, 1))
        _run(generator.update_weights(update, transport))
        assert generator.weight_version == 1
        after = self._greedy(generator, prompts)
        assert after != before, "new weights did not change greedy outputs"
        res = _run(generator.generate([_req("v", prompts[0], max_new_tokens=2)]))
        assert res[0].weight_version == 1

    def test_failed_update_keeps_weights(
        self, generator: Generator, prompts: list, transport: WeightTransport
    ) -> None:
        """A transport that raises WeightSyncError mid-stream leaves version and outputs as they
        were; a replayed update is refused too; the generator keeps serving.

        Troubleshooting: materialise and verify all tensors before touching the model (the
        default ``WeightTransport.apply`` does); let WeightSyncError propagate. If your engine
        does not go through ``transport.apply``, override :meth:`failing_update`.
        """
        before = self._greedy(generator, prompts)
        update, broken = self.failing_update(generator, transport, 1)
        with pytest.raises(WeightSyncError):
            _run(generator.update_weights(update, broken))
        assert generator.weight_version == 0
        assert self._greedy(generator, prompts) == before
        update2 = transport.publish(2, self._weights(generator, 3))
        _run(generator.update_weights(update2, transport))
        assert generator.weight_version == 2
        after = self._greedy(generator, prompts)
        with pytest.raises(WeightSyncError):
            _run(generator.update_weights(update2, transport))
        assert generator.weight_version == 2
        assert self._greedy(generator, prompts) == after

    def _long(self, rid: str, ids: Sequence[int], seed: int) -> GenerationRequest:
        return _req(rid, ids, max_new_tokens=self.abort_max_new_tokens, seed=seed, temperature=1.0)

    def test_abort_all_returns_partial(self, generator: Generator, prompts: list) -> None:
        """``abort()`` ends running requests with ABORT and their partial tokens and log-probs;
        the generator serves new requests afterwards (only if ``supports_abort``).

        Troubleshooting: check for aborts between decode steps and return what was sampled so
        far; do not raise. Raise ``abort_max_new_tokens`` if requests finish before the abort.
        """
        if not type(generator).supports_abort:
            pytest.skip("generator does not support abort")

        async def go() -> list[GenerationResult]:
            reqs = [self._long(f"a{i}", prompts[i % len(prompts)], seed=i) for i in range(8)]
            task = asyncio.ensure_future(generator.generate(reqs))
            await asyncio.sleep(self.abort_delay_s)
            await generator.abort()
            return await asyncio.wait_for(task, 30)

        res = _run(go())
        assert FinishReason.ABORT in {r.finish_reason for r in res}
        for r in res:
            assert r.finish_reason in (FinishReason.ABORT, FinishReason.STOP), r.finish_reason
            assert len(r.output_ids) == len(r.output_logprobs) < self.abort_max_new_tokens
        (after,) = _run(
            generator.generate([_req("n", prompts[0], max_new_tokens=4, stop_token_ids=())])
        )
        assert after.finish_reason != FinishReason.ABORT and len(after.output_ids) >= 1

    def test_abort_by_id(self, generator: Generator, prompts: list) -> None:
        """``abort(ids)`` ends only those requests; the others keep generating (only if
        ``supports_abort``).

        Troubleshooting: match aborts by ``request_id``; requests not named must not stop.
        """
        if not type(generator).supports_abort:
            pytest.skip("generator does not support abort")

        async def go() -> list[GenerationResult]:
            reqs = [self._long(f"a{i}", prompts[i % len(prompts)], seed=10 + i) for i in range(8)]
            tasks = [asyncio.ensure_future(generator.generate([q])) for q in reqs]
            await asyncio.sleep(self.abort_delay_s)
            await generator.abort(["a0", "a2", "a4", "a6", "not-a-request"])
            await asyncio.sleep(self.abort_delay_s)
            await generator.abort()
            return [(await asyncio.wait_for(t, 30))[0] for t in tasks]

        res = _run(go())
        first = [r for r in res[0::2] if r.finish_reason == FinishReason.ABORT]
        later = [r for r in res[1::2] if r.finish_reason == FinishReason.ABORT]
        assert first and later, [r.finish_reason for r in res]
        assert min(len(r.output_ids) for r in later) > max(len(r.output_ids) for r in first), (
            "requests not named in abort(ids) stopped early"
        )

    def test_pause_holds_new_work(self, generator: Generator, prompts: list) -> None:
        """After ``pause()`` a new request does not complete; after ``resume()`` it does, normally
        (only if ``supports_pause``).

        Troubleshooting: pause must hold (not drop or abort) new work, and resume must wake it.
        """
        if not type(generator).supports_pause:
            pytest.skip("generator does not support pause")

        async def go() -> tuple[bool, list[GenerationResult]]:
            await generator.pause()
            task = asyncio.ensure_future(
                generator.generate([_req("p", prompts[0], max_new_tokens=3)])
            )
            await asyncio.sleep(0.1)
            held = not task.done()
            await generator.resume()
            return held, await asyncio.wait_for(task, 30)

        held, res = _run(go())
        assert held, "a request completed while the generator was paused"
        assert res[0].request_id == "p" and res[0].finish_reason != FinishReason.ABORT

    def test_many_concurrent_calls(self, generator: Generator, prompts: list) -> None:
        """Many concurrent ``generate`` calls (``asyncio.gather``) all complete with their own
        results, and match the same requests sent in one call (seeded).

        Troubleshooting: do not hold a non-reentrant lock across awaits; batch or queue calls;
        route each result to the call that made the request.
        """
        reqs = [
            _req(f"c{i}", prompts[i % len(prompts)], max_new_tokens=4, seed=i) for i in range(40)
        ]

        async def go() -> list[list[GenerationResult]]:
            return await asyncio.wait_for(
                asyncio.gather(*(generator.generate([q]) for q in reqs)), 60
            )

        res = [r for (r,) in _run(go())]
        assert [r.request_id for r in res] == [q.request_id for q in reqs]
        if self.seed_batch_invariant:
            together = _run(generator.generate(reqs))
            assert [r.output_ids for r in res] == [r.output_ids for r in together]
