"""rl_hf.packed_logprobs: packed per-token log-probs of a plain transformers causal LM equal the
model run on each sequence alone, with gradients, and the model is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.batching import pack_sequences
from rl_core.errors import ConfigError
from rl_hf import build_tiny_model, packed_logprobs


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _alone(model, seqs: list[list[int]], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence through the model alone: log-probs and entropies [T] (0 at starts)."""
    lps, ents = [], []
    for seq in seqs:
        logits = model(torch.tensor([seq])).logits[0].float() / temperature
        logp_LV = torch.log_softmax(logits[:-1], dim=-1)
        lp = logp_LV.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        ent = -(logp_LV.exp() * logp_LV).sum(-1)
        lps.append(torch.cat([torch.zeros(1), lp]))
        ents.append(torch.cat([torch.zeros(1), ent]))
    return torch.cat(lps), torch.cat(ents)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_equals_each_sequence_alone_with_gradients(model_path: Path, attn: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), attn_implementation=attn)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 1, 19, 4, 12)]
    out = packed_logprobs(model, seqs, temperature=0.7, with_entropy=True)
    assert model.config._attn_implementation == attn  # restored
    with torch.no_grad():
        want_lp, want_ent = _alone(model, seqs, 0.7)
    assert out.logprobs.shape == (sum(map(len, seqs)),)
    torch.testing.assert_close(out.logprobs.detach(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.detach(), want_ent, rtol=1e-5, atol=1e-5)
    starts = pack_sequences(seqs).cu_seqlens[:-1]
    assert (out.logprobs[starts] == 0).all()

    # gradients equal the per-sequence ones
    out.logprobs.sum().backward()
    packed_grad = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, _ = _alone(model, seqs, 0.7)
    lp.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grad[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)

    # a TrainBatch works the same; different sequences are not mixed (prefix changes stay local)
    batch = pack_sequences(seqs)
    with torch.no_grad():
        again = packed_logprobs(model, batch, temperature=0.7).logprobs
        seqs[0][2] += 1
        changed = packed_logprobs(model, seqs, temperature=0.7).logprobs
    torch.testing.assert_close(again, want_lp, rtol=1e-5, atol=1e-5)
    n0 = len(seqs[0])
    assert not torch.allclose(changed[:n0], want_lp[:n0])
    torch.testing.assert_close(changed[n0:], want_lp[n0:], rtol=1e-5, atol=1e-5)


def test_refusals(model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        packed_logprobs(model, [[1, 2, 3]], temperature=0.0)
    with pytest.raises(ConfigError, match="not a transformers PreTrainedModel"):
        packed_logprobs(torch.nn.Linear(2, 2), [[1, 2, 3]])
    empty = packed_logprobs(model, [])
    assert empty.logprobs.shape == (0,)
