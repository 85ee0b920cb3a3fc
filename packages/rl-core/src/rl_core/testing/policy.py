"""Conformance suite for :class:`~rl_core.interfaces.Policy`, and small batch builders.

Subclass the suite in your policy's tests and provide a freshly built policy on a tiny model::

    class TestMyPolicy(PolicyConformance):
        @pytest.fixture
        def policy(self, tiny_model_dir):
            return MyPolicy(MyPolicy.Config(model_path=str(tiny_model_dir), lr=1e-2))

The fixture must give a *fresh* policy (version 0, no optimizer steps yet) whose learning rate
lets a few steps of supervised fine-tuning on one small batch lower the loss (AdamW at ``1e-2``
on a tiny random model does). Optional behaviour is behind flags: set
``supports_load_weights = False`` if the policy is not a :class:`~rl_core.interfaces.WeightTarget`,
``supports_offload = True`` to test ``offload``/``onload``. ``logprob_atol`` is the tolerance of
the exactness tests (packing, micro-batches, save/load); raise it for bfloat16 policies.

Distributed policies run the suite in every process of the job (the same tests in the same
order, so collective calls meet their peers). ``compute_logprobs``, ``named_weights``,
``save``/``load`` and the metrics ``train_step`` returns are checked on every process as they
are. Three hooks (methods of the suite, overridden in the test class) say how training is split:

``train_shards(policy)``
    How many data-parallel shards a training batch is planned into (``TrainBatch.dp_bounds``,
    sequences split evenly, each shard on its own micro-batch bounds). Default 1: no plan.
``local_train_batch(policy, batch)``
    The part of a planned batch this process passes to ``train_step``. Default: the whole batch
    (a single process, or a policy that shards ``dp_bounds`` itself). A policy whose processes
    each train on their own shard returns ``batch.shard(its data-parallel rank)``.
``runs_loss_fn(policy)``
    Whether ``train_step`` calls the loss function in this process (once per micro-batch of
    the local batch). Default ``True``; ``False`` where it must not be called at all (pipeline
    stages before the last).

Whatever the split, ``loss_weights`` are computed over the whole batch and the step's ``loss``
and loss-function metrics must be the sums over *all* shards and micro-batches (the
single-process values of the whole batch), on every process: a policy that averages over
data-parallel ranks, counts a replica twice or trains on the whole batch in every rank fails
``test_train_step_contract``. A data-parallel example::

    class TestMyPolicyDP2(PolicyConformance):
        def train_shards(self, policy):
            return policy.layout.dp_size

        def local_train_batch(self, policy, batch):
            return batch.shard(policy.layout.dp_rank)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from rl_core.batching import pack_sequences
from rl_core.interfaces import LossFn, Policy
from rl_core.testing._base import ConformanceSuite
from rl_core.types import LossOutput, TrainBatch

__all__ = [
    "PolicyConformance",
    "pack_sequences",
    "random_batch",
    "sft_loss",
    "shared_prompt_batch",
]


def shared_prompt_batch(
    vocab_size: int,
    groups: Sequence[tuple[int, Sequence[int]]],
    *,
    seed: int = 0,
    micro_batch_bounds: tuple[int, ...] = (),
) -> TrainBatch:
    """Random sequences ``prompt + response`` for each ``(prompt_len, [response_len, ...])``
    group: a group's samples share the prompt (as a GRPO group's do), ``loss_mask`` is 1 on
    responses only, advantages are random on them, and the sequences are interleaved so that
    groups are not contiguous. For tests of prefix sharing."""
    gen = torch.Generator().manual_seed(seed)
    seqs: list[tuple[torch.Tensor, int]] = []
    for prompt_len, responses in groups:
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=gen)
        for r in responses:
            seqs.append(
                (torch.cat([prompt, torch.randint(0, vocab_size, (r,), generator=gen)]), prompt_len)
            )
    order = sorted(range(len(seqs)), key=lambda i: (i % 3, i))
    tokens, masks, lengths = [], [], []
    for i in order:
        seq, p = seqs[i]
        tokens.append(seq)
        mask = torch.zeros(seq.shape[0])
        mask[p:] = 1.0
        masks.append(mask)
        lengths.append(seq.shape[0])
    mask_T = torch.cat(masks)
    cu_N1 = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu_N1[1:] = torch.tensor(lengths).cumsum(0)
    adv_T = torch.randn(mask_T.shape[0], generator=gen) * mask_T
    return TrainBatch(
        tokens=torch.cat(tokens),
        cu_seqlens=cu_N1,
        loss_mask=mask_T,
        loss_weights=mask_T / mask_T.sum(),
        advantages=adv_T,
        micro_batch_bounds=micro_batch_bounds,
    )


def random_batch(
    vocab_size: int,
    lengths: Sequence[int],
    *,
    seed: int = 0,
    micro_batch_bounds: tuple[int, ...] = (),
) -> TrainBatch:
    """A :func:`pack_sequences` batch of uniformly random token ids in ``[0, vocab_size)``."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    return pack_sequences(seqs, micro_batch_bounds=micro_batch_bounds)


def sft_loss(logp_T: torch.Tensor, batch: TrainBatch, entropy_T: torch.Tensor | None) -> LossOutput:
    """Supervised fine-tuning loss ``-sum_t logp_t * loss_weights_t`` (a :class:`LossFn`).

    Metrics: ``tokens`` (masked tokens in the micro-batch) and ``sum_logp`` (weighted log-prob).
    """
    weighted_T = logp_T * batch.loss_weights.to(logp_T.device)
    return LossOutput(
        loss=-weighted_T.sum(),
        metrics={
            "tokens": float(batch.loss_mask.sum()),
            "sum_logp": float(weighted_T.detach().sum()),
        },
    )


def _snapshot(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in policy.named_weights()}


def _flat_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    assert sorted(a) == sorted(b), "weight names differ"
    return torch.cat([(a[k].double() - b[k].double()).abs().reshape(-1) for k in sorted(a)])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), "weight names differ"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


class PolicyConformance(ConformanceSuite):
    """Standard behaviour every :class:`~rl_core.interfaces.Policy` must show (see module doc)."""

    __test__ = False

    supports_load_weights: ClassVar[bool] = True
    """The policy is also a ``WeightTarget`` (``load_weights``, ``weight_version``)."""
    supports_offload: ClassVar[bool] = False
    """``offload()``/``onload()`` actually move state (and must leave results unchanged)."""
    logprob_atol: ClassVar[float] = 1e-5
    """Absolute tolerance of the exactness checks."""
    sft_steps: ClassVar[int] = 5
    """Optimizer steps of the SFT-learns test."""

    @pytest.fixture
    def policy(self) -> Policy:
        """A freshly built policy on a tiny model (override in your test class)."""
        raise NotImplementedError("Override the `policy` fixture to return a fresh Policy.")

    # -------------------------------------------------------------- hooks (see module doc)

    def train_shards(self, policy: Policy) -> int:
        """Data-parallel shards a training batch is planned into (default 1: no plan; at most 2,
        the sequences of the suite's smallest training batch)."""
        return 1

    def local_train_batch(self, policy: Policy, batch: TrainBatch) -> TrainBatch:
        """The part of a planned training batch this process passes to ``train_step`` (default:
        all of it)."""
        return batch

    def runs_loss_fn(self, policy: Policy) -> bool:
        """``train_step`` calls the loss function in this process (default ``True``)."""
        return True

    # -------------------------------------------------------------- helpers

    @staticmethod
    def _vocab(policy: Policy) -> int:
        return policy.model_shape.vocab_size

    def _batch(
        self, policy: Policy, lengths: Sequence[int], *, seed: int = 0, bounds: tuple[int, ...] = ()
    ) -> TrainBatch:
        return random_batch(self._vocab(policy), lengths, seed=seed, micro_batch_bounds=bounds)

    def _train_batch(
        self, policy: Policy, lengths: Sequence[int], *, seed: int = 0, bounds: tuple[int, ...] = ()
    ) -> TrainBatch:
        """A :meth:`_batch` planned into :meth:`train_shards` data-parallel shards: sequences
        split evenly, the shard bounds added to the micro-batch bounds, ``loss_weights`` over
        the whole batch."""
        batch = self._batch(policy, lengths, seed=seed, bounds=bounds)
        shards = self.train_shards(policy)
        if shards == 1:
            return batch
        n = batch.num_sequences
        if not 1 <= shards <= n:
            raise ValueError(
                f"{type(self).__name__}.train_shards: {shards}, but this {n}-sequence suite "
                f"batch can be planned into 1 to {n} non-empty shards; run the suite with at "
                f"most {n} data-parallel ranks."
            )
        dp_bounds = tuple(i * n // shards for i in range(shards + 1))
        micro = tuple(sorted(set(bounds or (0, n)) | set(dp_bounds)))
        return dataclasses.replace(batch, micro_batch_bounds=micro, dp_bounds=dp_bounds)

    def _train(self, policy: Policy, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """``train_step`` on this process's part of a :meth:`_train_batch`."""
        return policy.train_step(self.local_train_batch(policy, batch), loss_fn)

    # -------------------------------------------------------------- log-probs

    def test_logprobs_shape_and_range(self, policy: Policy) -> None:
        """``compute_logprobs`` returns ``[T]`` float log-probs: finite, <= 0, exactly 0 at every
        sequence start.

        Troubleshooting: a length of ``T - N`` or ``T - 1`` means the shift was not re-aligned to
        ``tokens``; non-zero starts mean the first token of a sequence was scored against the
        previous sequence's last logits; positive values mean logits, not log-softmax, came back.
        """
        batch = self._batch(policy, [5, 1, 9, 3])
        out = policy.compute_logprobs(batch)
        logp_T = out.logprobs
        assert logp_T.shape == (batch.num_tokens,)
        assert logp_T.dtype == torch.float32
        assert torch.isfinite(logp_T).all()
        assert (logp_T <= 0).all()
        starts = batch.cu_seqlens[:-1]
        assert (logp_T[starts] == 0).all()
        rest_T = torch.ones(batch.num_tokens, dtype=torch.bool)
        rest_T[starts] = False
        assert (logp_T[rest_T] < 0).all(), "non-start tokens should have a proper log-prob"

    def test_packing_invariance(self, policy: Policy) -> None:
        """Log-probs of sequences packed together equal each sequence scored alone.

        Troubleshooting: a mismatch means attention leaks across packed sequences (no
        block-diagonal mask / varlen attention) or position ids are not reset per sequence.
        """
        lengths = [7, 1, 12, 4]
        packed = self._batch(policy, lengths, seed=1)
        logp_T = policy.compute_logprobs(packed).logprobs
        for i in range(len(lengths)):
            a, b = int(packed.cu_seqlens[i]), int(packed.cu_seqlens[i + 1])
            alone = pack_sequences([packed.tokens[a:b]])
            logp_alone = policy.compute_logprobs(alone).logprobs
            torch.testing.assert_close(logp_T[a:b], logp_alone, atol=self.logprob_atol, rtol=0)

    def test_logprobs_independent_of_micro_batches(self, policy: Policy) -> None:
        """``compute_logprobs`` gives the same values whatever ``micro_batch_bounds`` says, and
        does not change ``version``.

        Troubleshooting: a mismatch means micro-batch outputs are concatenated out of order or
        sliced with the wrong token offsets (``cu_seqlens`` of a micro-batch start at 0).
        """
        lengths = [4, 9, 2, 6, 5]
        whole = self._batch(policy, lengths, seed=10)
        split = self._batch(policy, lengths, seed=10, bounds=(0, 2, 3, 5))
        version = policy.version
        torch.testing.assert_close(
            policy.compute_logprobs(split, with_entropy=True).logprobs,
            policy.compute_logprobs(whole).logprobs,
            atol=self.logprob_atol,
            rtol=0,
        )
        assert policy.version == version

    def test_entropy_bounds(self, policy: Policy) -> None:
        """Entropy ``[T]`` is 0 at sequence starts and within ``[0, log V]`` elsewhere, and asking
        for it does not change the log-probs.

        Troubleshooting: negative values usually mean ``sum p * log p`` was taken with the wrong
        sign or on un-normalised logits; values above ``log V`` mean the distribution was not
        normalised (or the temperature applied twice).
        """
        batch = self._batch(policy, [6, 10], seed=2)
        out = policy.compute_logprobs(batch, with_entropy=True)
        assert out.entropy is not None
        ent_T = out.entropy
        assert ent_T.shape == (batch.num_tokens,)
        assert torch.isfinite(ent_T).all()
        assert (ent_T >= 0).all()
        assert (ent_T <= math.log(self._vocab(policy)) + 1e-4).all()
        assert (ent_T[batch.cu_seqlens[:-1]] == 0).all()
        plain_T = policy.compute_logprobs(batch).logprobs
        torch.testing.assert_close(out.logprobs, plain_T, atol=self.logprob_atol, rtol=0)

    # -------------------------------------------------------------- training

    def test_train_step_contract(self, policy: Policy) -> None:
        """``train_step`` adds 1 to ``version``; returns finite ``loss`` and ``grad_norm``; the
        loss function sees the same log-probs ``compute_logprobs`` gives; ``loss`` and loss
        metrics are summed (not averaged) over micro-batches and data-parallel shards.

        The loss function must run once per micro-batch of this process's batch where
        :meth:`runs_loss_fn` says so, and not at all elsewhere. ``loss`` and ``tokens`` must be
        the values of the *whole* batch on every process.

        Troubleshooting: a loss 1/k of the expected value means losses were divided by the
        number of micro-batches or data-parallel ranks (they are already weighted); k times
        the expected value means a shard was counted k times (every tensor-parallel rank, or
        every rank trained on the whole batch); a log-prob mismatch means the training forward
        differs from the inference one (temperature, packing, dtype).
        """
        batch = self._train_batch(policy, [5, 8, 3, 6, 4, 7], seed=3, bounds=(0, 2, 3, 6))
        local = self.local_train_batch(policy, batch)
        before_T = policy.compute_logprobs(batch).logprobs
        local_T = before_T if local is batch else policy.compute_logprobs(local).logprobs
        seen: list[torch.Tensor] = []

        def loss_fn(logp_T: torch.Tensor, mb: TrainBatch, ent: torch.Tensor | None) -> LossOutput:
            assert logp_T.requires_grad, "train_step must pass log-probs that carry gradients"
            seen.append(logp_T.detach().cpu())
            return sft_loss(logp_T, mb, ent)

        v0 = policy.version
        metrics = policy.train_step(local, loss_fn)
        assert policy.version == v0 + 1
        if self.runs_loss_fn(policy):
            assert len(seen) == len(local.micro_batches()), "one loss_fn call per micro-batch"
            torch.testing.assert_close(torch.cat(seen), local_T, atol=self.logprob_atol, rtol=0)
        else:
            assert not seen, "loss_fn was called where runs_loss_fn says it must not be"
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        assert metrics["grad_norm"] > 0
        expected_loss = -float((before_T * batch.loss_weights).sum())
        assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6), (
            f"step loss {metrics['loss']:.6g}, expected {expected_loss:.6g} (the whole batch's)"
        )
        tokens = float(batch.loss_mask.sum())
        assert metrics["tokens"] == tokens, f"tokens {metrics['tokens']}, expected {tokens}"
        after_T = policy.compute_logprobs(batch).logprobs
        assert not torch.equal(after_T, before_T), "weights did not change"

    def test_sft_loss_decreases(self, policy: Policy) -> None:
        """A few SFT steps on one fixed batch lower the loss.

        Troubleshooting: if the loss does not move, check the optimizer sees the parameters and
        the learning rate of the fixture (a tiny random model needs about 1e-2 with AdamW); if it
        rises, the loss sign or the gradient direction is wrong.
        """
        batch = self._train_batch(policy, [12, 9, 15], seed=4)
        losses = [self._train(policy, batch, sft_loss)["loss"] for _ in range(self.sft_steps)]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0] - 0.1, f"loss did not decrease: {losses}"
        assert policy.version == self.sft_steps

    def test_micro_batch_invariance(self, policy: Policy, tmp_path: Path) -> None:
        """One step on a batch as 1 micro-batch or as 3 gives the same weights, loss and grad norm
        (with data-parallel shards: one micro-batch per shard, or the 3 split at the shard
        bounds).

        Both steps start from the same state (the policy is saved before the first and loaded,
        optimizer included, before the second). Loss and gradient norm must agree to 1e-5
        (relative). Weights: at most 0.1% of the entries may differ by more than
        ``logprob_atol``, and the mean difference must stay below 0.1% of the mean update. (The
        first Adam step ``g / (|g| + eps)`` turns the float rounding of a few tiny gradient
        entries into visible differences; accumulation bugs move a large share of the weights
        by about the learning rate.)

        Troubleshooting: a mismatch means gradients are not accumulated across micro-batches
        (zeroed in between, averaged, or only the last one applied), or the optimizer steps
        once per micro-batch instead of once per ``train_step``.
        """
        lengths = [5, 8, 3, 6, 4, 7]
        whole = self._train_batch(policy, lengths, seed=5)
        split = self._train_batch(policy, lengths, seed=5, bounds=(0, 1, 4, 6))
        w_start = _snapshot(policy)
        policy.save(tmp_path / "start", with_optimizer=True)
        m_whole = self._train(policy, whole, sft_loss)
        w_whole = _snapshot(policy)
        policy.load(tmp_path / "start", with_optimizer=True)
        assert _max_diff(_snapshot(policy), w_start) == 0.0, "load did not restore the weights"
        m_split = self._train(policy, split, sft_loss)
        w_split = _snapshot(policy)
        assert m_split["loss"] == pytest.approx(m_whole["loss"], rel=1e-5, abs=1e-6)
        assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5, abs=1e-6)
        update_W = _flat_abs_diff(w_whole, w_start)
        diff_W = _flat_abs_diff(w_whole, w_split)
        assert update_W.max() > 0, "the step did not change the weights"
        share = float((diff_W > self.logprob_atol).float().mean())
        assert share <= 1e-3, f"{share:.2%} of the weights differ by more than {self.logprob_atol}"
        assert diff_W.mean() <= 1e-3 * update_W.mean(), (
            f"mean weight difference {float(diff_W.mean()):.3g} vs mean update "
            f"{float(update_W.mean()):.3g}"
        )

    # -------------------------------------------------------------- weights and checkpoints

    def test_named_weights(self, policy: Policy) -> None:
        """``named_weights`` yields unique Hugging Face names with finite, detached tensors; names
        and shapes are the same on every call and after a train step.

        Troubleshooting: duplicate names usually come from tied embeddings exported twice under
        the same name; ``requires_grad`` tensors mean the weights were not detached; changing
        names mean internal (e.g. Megatron) names leak instead of HF names.
        """
        first = [(n, tuple(t.shape)) for n, t in policy.named_weights()]
        names = [n for n, _ in first]
        assert names and len(set(names)) == len(names)
        assert any("embed" in n for n in names), "expected an embedding weight in HF naming"
        for name, tensor in policy.named_weights():
            assert not tensor.requires_grad, name
            assert torch.isfinite(tensor).all(), name
        assert [(n, tuple(t.shape)) for n, t in policy.named_weights()] == first
        self._train(policy, self._train_batch(policy, [6, 5], seed=6), sft_loss)
        assert [(n, tuple(t.shape)) for n, t in policy.named_weights()] == first

    def test_save_load_roundtrip(self, policy: Policy, tmp_path: Path) -> None:
        """After ``save``, training on, then ``load``, log-probs and ``version`` are those of the
        saved state.

        Troubleshooting: a version mismatch means ``save`` does not record it; different
        log-probs mean some weights (often tied or non-persistent ones) are not saved or not
        restored.
        """
        batch = self._train_batch(policy, [8, 5], seed=7)
        self._train(policy, batch, sft_loss)
        policy.save(tmp_path / "ckpt", with_optimizer=True)
        saved_T = policy.compute_logprobs(batch).logprobs
        saved_version = policy.version
        self._train(policy, batch, sft_loss)
        assert not torch.equal(policy.compute_logprobs(batch).logprobs, saved_T)
        policy.load(tmp_path / "ckpt", with_optimizer=True)
        assert policy.version == saved_version
        torch.testing.assert_close(
            policy.compute_logprobs(batch).logprobs, saved_T, atol=self.logprob_atol, rtol=0
        )

    def test_load_weights_sets_weights_and_version(self, policy: Policy) -> None:
        """``load_weights`` with changed tensors changes the log-probs and sets the version;
        loading the original tensors back restores the original log-probs.

        Troubleshooting: unchanged log-probs mean the tensors were copied into a detached copy
        (e.g. a fresh ``state_dict`` of a different module) instead of the live weights.
        """
        if not self.supports_load_weights:
            pytest.skip("policy is not a WeightTarget (supports_load_weights = False)")
        batch = self._batch(policy, [7, 6], seed=8)
        base_T = policy.compute_logprobs(batch).logprobs
        original = _snapshot(policy)
        gen = torch.Generator().manual_seed(0)
        changed = [
            (n, t + 0.05 * torch.randn(t.shape, generator=gen).to(t.dtype))
            for n, t in original.items()
        ]
        policy.load_weights(changed, version=7)  # type: ignore[attr-defined]
        assert policy.weight_version == 7  # type: ignore[attr-defined]
        assert policy.version == 7
        assert (policy.compute_logprobs(batch).logprobs - base_T).abs().max() > 1e-3
        policy.load_weights(original.items(), version=8)  # type: ignore[attr-defined]
        torch.testing.assert_close(
            policy.compute_logprobs(batch).logprobs, base_T, atol=self.logprob_atol, rtol=0
        )

    def test_model_shape(self, policy: Policy) -> None:
        """``model_shape`` describes a real transformer: positive sizes, query heads a multiple
        of key/value heads, and a vocabulary that covers the tokens the suite feeds.

        Troubleshooting: zeros usually mean a config field was read under the wrong name (e.g.
        ``num_key_value_heads`` missing in older configs means ``num_attention_heads``).
        """
        shape = policy.model_shape
        for field in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
        ):
            assert getattr(shape, field) > 0, field
        assert shape.num_attention_heads % shape.num_kv_heads == 0
        top = pack_sequences([[0, shape.vocab_size - 1]])
        assert policy.compute_logprobs(top).logprobs.shape == (2,)

    def test_lora_trains_adapter_only(self, policy: Policy) -> None:
        """With ``policy.lora`` set: a fresh adapter leaves the model as it was (base log-probs
        equal the policy's); ``named_adapter_weights`` yields peft names with ``A`` ``[r, in]``
        and ``B`` ``[out, r]``; a step changes the adapter and the (merged) log-probs but not
        the base log-probs. Skipped for full fine-tuning (``lora`` is ``None``).

        Troubleshooting: changed base log-probs mean the base is not frozen (the optimizer
        holds base weights) or disabling the adapters does not reach every layer; a fresh
        adapter that changes the model means ``B`` was not initialised to zero.
        """
        lora = policy.lora
        if lora is None:
            pytest.skip("the policy trains every weight (policy.lora is None)")
        from rl_core.lora import module_of

        batch = self._train_batch(policy, [6, 9], seed=11)
        base_T = policy.compute_base_logprobs(batch).logprobs
        torch.testing.assert_close(
            policy.compute_logprobs(batch).logprobs, base_T, atol=self.logprob_atol, rtol=0
        )
        before = {n: t.detach().cpu().clone() for n, t in policy.named_adapter_weights()}
        assert before, "named_adapter_weights yielded nothing"
        for full, tensor in before.items():
            name = full
            if lora.adapters:  # multi-LoRA: "<adapter>/<peft name>" (adapter_tensor_name)
                adapter, _, name = full.partition("/")
                assert adapter in lora.adapter_names, full
            module, which = module_of(name)
            assert name.startswith("base_model.model."), name
            assert lora.targets(module), f"{name}: not a target of policy.lora"
            assert tensor.shape[0 if which == "A" else 1] == lora.rank, (name, tensor.shape)
        self._train(policy, batch, sft_loss)
        after = {n: t.detach().cpu() for n, t in policy.named_adapter_weights()}
        assert sorted(after) == sorted(before)
        assert _max_diff(after, before) > 0, "the adapter did not change"
        assert not torch.equal(policy.compute_logprobs(batch).logprobs, base_T)
        torch.testing.assert_close(
            policy.compute_base_logprobs(batch).logprobs, base_T, atol=self.logprob_atol, rtol=0
        )

    def test_offload_onload(self, policy: Policy) -> None:
        """``offload`` then ``onload`` leaves log-probs and version unchanged.

        Troubleshooting: differences mean some state was dropped or re-initialised instead of
        moved.
        """
        if not self.supports_offload:
            pytest.skip("policy does not support offload (supports_offload = False)")
        batch = self._batch(policy, [6, 4], seed=9)
        before_T = policy.compute_logprobs(batch).logprobs
        version = policy.version
        policy.offload()
        policy.onload()
        assert policy.version == version
        torch.testing.assert_close(
            policy.compute_logprobs(batch).logprobs, before_T, atol=self.logprob_atol, rtol=0
        )
