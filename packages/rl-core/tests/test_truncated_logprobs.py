"""Top-p / top-k-aware log-probs (rl_core.logprobs.truncate_logits and the ``top_p``/``top_k`` of
linear_logprobs): hand-computed renormalised values, ties at the threshold, the scored token
kept, temperature before top-p, the truncated entropy, and the chunked path (values and
gradients) equal to the plain one."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.logprobs import linear_logprobs, truncate_logits

NEG = float("-inf")


def _logits(*probs: float) -> torch.Tensor:
    """``[1, V]`` float64 logits whose softmax is ``probs``."""
    return torch.tensor([probs], dtype=torch.float64).log()


def _logp(probs: tuple[float, ...], target: int, **kw) -> tuple[float, float]:
    """(log-prob of ``target``, entropy) through linear_logprobs with an identity head, so the
    logits are exactly ``log(probs)``; checks the chunked path agrees with the plain one."""
    z_1V = _logits(*probs)
    eye_VV = torch.eye(z_1V.shape[1], dtype=torch.float64)
    t_1 = torch.tensor([target])
    out = []
    for chunk in (0, 1):
        logp_S, ent_S = linear_logprobs(
            z_1V, eye_VV, t_1, with_entropy=True, chunk_tokens=chunk, **kw
        )
        out.append((float(logp_S[0]), float(ent_S[0])))
    assert out[0] == pytest.approx(out[1], abs=1e-12)
    return out[0]


def _entropy(*q: float) -> float:
    return -sum(x * math.log(x) for x in q)


def test_top_p_only_renormalises_over_the_nucleus() -> None:
    # sorted mass before each token: 0, .4, .7, .9 -> tokens 0..2 are the nucleus of 0.8
    kept = truncate_logits(_logits(0.4, 0.3, 0.2, 0.1), top_p=0.8)
    assert torch.isinf(kept[0, 3]) and torch.isfinite(kept[0, :3]).all()
    logp, ent = _logp((0.4, 0.3, 0.2, 0.1), 2, top_p=0.8)
    assert logp == pytest.approx(math.log(0.2 / 0.9), abs=1e-12)
    assert ent == pytest.approx(_entropy(4 / 9, 3 / 9, 2 / 9), abs=1e-12)
    # untruncated: the full distribution (the biased value the ratio sees without the option)
    assert _logp((0.4, 0.3, 0.2, 0.1), 2)[0] == pytest.approx(math.log(0.2), abs=1e-12)


def test_top_k_only() -> None:
    logp, ent = _logp((0.4, 0.3, 0.2, 0.1), 0, top_k=2)
    assert logp == pytest.approx(math.log(0.4 / 0.7), abs=1e-12)
    assert ent == pytest.approx(_entropy(4 / 7, 3 / 7), abs=1e-12)


def test_top_k_then_top_p_on_the_renormalised_top_k_mass() -> None:
    # top-3 renormalised: 4/9, 3/9, 2/9; mass before: 0, .444, .778 -> top_p .6 keeps two
    logp, _ = _logp((0.4, 0.3, 0.2, 0.1), 1, top_k=3, top_p=0.6)
    assert logp == pytest.approx(math.log(3 / 7), abs=1e-12)
    # over the full distribution top_p .6 would also keep two, but top_p .75 differs:
    # full: before 0, .4, .7 -> three kept; after top-2: before 0, 4/7 -> two kept
    assert _logp((0.4, 0.3, 0.2, 0.1), 0, top_p=0.75)[0] == pytest.approx(math.log(0.4 / 0.9))
    assert _logp((0.4, 0.3, 0.2, 0.1), 0, top_p=0.75, top_k=2)[0] == pytest.approx(
        math.log(0.4 / 0.7)
    )


def test_ties_at_the_top_k_threshold_are_all_kept() -> None:
    # the 2nd-largest logit is tied with the 3rd: both stay (3 candidates for k = 2)
    kept = truncate_logits(_logits(0.4, 0.2, 0.2, 0.1, 0.1), top_k=2)
    assert torch.isfinite(kept[0, :3]).all() and torch.isinf(kept[0, 3:]).all()
    assert _logp((0.4, 0.2, 0.2, 0.1, 0.1), 1, top_k=2)[0] == pytest.approx(math.log(0.2 / 0.8))


def test_ties_at_the_top_p_threshold_are_all_kept() -> None:
    # sorted mass before: 0, .4, .6 -> a sort-order cut at p=.5 keeps two tokens, one of the
    # tied pair; the value rule keeps the whole tie group (mass above both is .4 < .5)
    kept = truncate_logits(_logits(0.2, 0.4, 0.1, 0.2, 0.1), top_p=0.5)
    assert kept[0].isfinite().tolist() == [True, True, False, True, False]
    assert _logp((0.2, 0.4, 0.1, 0.2, 0.1), 1, top_p=0.5)[0] == pytest.approx(math.log(0.5))


def test_scored_token_stays_a_candidate() -> None:
    # top-1 keeps token 0 only; scoring token 4 adds it: {0, 4}, mass .5
    kept = truncate_logits(_logits(0.4, 0.2, 0.2, 0.1, 0.1), top_k=1, keep_R=torch.tensor([4]))
    assert kept[0].isfinite().tolist() == [True, False, False, False, True]
    assert _logp((0.4, 0.2, 0.2, 0.1, 0.1), 4, top_k=1)[0] == pytest.approx(math.log(0.1 / 0.5))


def test_top_p_applies_to_the_temperature_scaled_distribution() -> None:
    # T = 0.5 squares the probabilities: .16, .09, .04, .01 over .30 -> mass before .533, .833:
    # top_p .8 keeps two (at T = 1 it keeps three)
    logp, _ = _logp((0.4, 0.3, 0.2, 0.1), 0, top_p=0.8, temperature=0.5)
    assert logp == pytest.approx(math.log(0.16 / 0.25), abs=1e-12)


def test_nothing_truncates_at_the_defaults() -> None:
    z = _logits(0.4, 0.3, 0.2, 0.1)
    assert truncate_logits(z) is z and truncate_logits(z, top_p=1.0, top_k=0) is z
    assert torch.equal(truncate_logits(z, top_k=4), z)  # k = V keeps all


@pytest.mark.parametrize("kw", [{"top_p": 0.8}, {"top_k": 5}, {"top_p": 0.9, "top_k": 20}])
def test_chunked_equals_unchunked_under_truncation(kw: dict) -> None:
    g = torch.Generator().manual_seed(0)
    hidden_SH = torch.randn(23, 16, generator=g) * 2
    weight_VH = torch.randn(64, 16, generator=g) / 4
    targets_S = torch.randint(0, 64, (23,), generator=g)
    g_logp_S, g_ent_S = torch.randn(23, generator=g), torch.randn(23, generator=g)
    res = []
    for chunk in (0, 5):
        h = hidden_SH.clone().requires_grad_()
        w = weight_VH.clone().requires_grad_()
        logp_S, ent_S = linear_logprobs(
            h, w, targets_S, temperature=0.7, with_entropy=True, chunk_tokens=chunk, **kw
        )
        ((logp_S * g_logp_S).sum() + (ent_S * g_ent_S).sum()).backward()
        assert torch.isfinite(logp_S).all() and torch.isfinite(h.grad).all()
        res.append((logp_S.detach(), ent_S.detach(), h.grad, w.grad))
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    full_S, _ = linear_logprobs(hidden_SH, weight_VH, targets_S, temperature=0.7)
    assert (res[0][0] >= full_S - 1e-6).all()  # renormalising only raises a log-prob
    assert (res[0][0] > full_S + 1e-3).any()


def test_truncation_is_refused_under_tensor_parallelism(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    z = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="tensor parallelism"):
        linear_logprobs(z, torch.eye(4), torch.tensor([0, 1]), top_p=0.9, group=object())
