"""SGLangTeacher: log-probs of given token ids from an SGLang server (a distillation teacher).

Scores each packed sequence of a :class:`~rl_core.types.TrainBatch` with one ``/generate``
request that returns the input's log-probs (slime's on-policy distillation makes the same call
with ``max_new_tokens: 0``; one greedy token, ignored, is the form the rl-sglang tests verify on
SGLang 0.5.23)::

    {"input_ids": [...], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
     "return_logprob": true, "logprob_start_len": 0}

The answer's ``meta_info.input_token_logprobs`` is ``[[logprob, token_id, text], ...]`` with
``null`` at the first position; entry ``t`` is ``log p(tokens[t] | tokens[:t])``, which is what
:meth:`~SGLangTeacher.compute_logprobs` returns at packed position ``t`` (0 at sequence starts, as
the policy backends do). The token ids in the answer are checked against the request.

The server runs separately (launched by hand or by :class:`~rl_sglang.SGLangGenerator` for
another model) and must serve the teacher model with the student's tokenizer. SGLang's input
log-probs come from the raw logits (temperature 1); a run sampling at another temperature
scores its student at that temperature, so use temperature 1 with an SGLang teacher or know
that the two differ. Requests run ``concurrency`` at a time from a thread pool (the trainer's
batch stage is synchronous); connection errors and 5xx answers are retried ``max_retries``
times, after which :class:`~rl_core.errors.RLError` names the server and the cause.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.config import NonNegInt, PositiveFloat, PositiveInt
from rl_core.errors import ConfigError, RLError
from rl_core.types import LogProbOutput, TrainBatch

__all__ = ["SGLangTeacher"]


class SGLangTeacher:
    """A frozen teacher behind an SGLang server: ``compute_logprobs(batch)`` only."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`SGLangTeacher`."""

        url: str
        """Server or router base URL, e.g. ``http://127.0.0.1:30000``."""
        timeout_s: PositiveFloat = 120.0
        """Time limit of one request."""
        max_retries: NonNegInt = 3
        """Retries of a request after a connection error or a 5xx answer."""
        concurrency: PositiveInt = 16
        """Requests in flight at once."""

        def __post_init__(self) -> None:
            if not self.url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"teacher.url: {self.url!r} is not an http(s) URL; give e.g. "
                    "'http://127.0.0.1:30000'."
                )

    def __init__(self, config: Config) -> None:
        self.config = config
        """The settings (read-only)."""
        self.version = 0
        """Always 0: the teacher never trains."""

    def _score(self, token_ids: list[int]) -> list[float]:
        """Log-probs ``[L]`` of one sequence (0 at its first position)."""
        body = {
            "input_ids": token_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        url = self.config.url.rstrip("/") + "/generate"
        data = json.dumps(body).encode()
        for attempt in range(self.config.max_retries + 1):
            request = urllib.request.Request(
                url, data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.config.timeout_s) as resp:
                    answer = json.loads(resp.read())
                break
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == self.config.max_retries:
                    raise RLError(
                        f"teacher: {url} answered HTTP {e.code} ({e.read()[:200]!r}); check "
                        "that teacher.url serves the teacher model."
                    ) from None
            except (urllib.error.URLError, OSError) as e:
                if attempt == self.config.max_retries:
                    raise RLError(
                        f"teacher: cannot reach the SGLang server at {url} ({e}); start it or "
                        "fix teacher.url."
                    ) from None
            time.sleep(0.5 * 2**attempt)
        if isinstance(answer, list):
            answer = answer[0]
        entries = answer.get("meta_info", {}).get("input_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(token_ids):
            raise RLError(
                f"teacher: {url} returned no input_token_logprobs for {len(token_ids)} tokens "
                f"(got {None if entries is None else len(entries)}); an SGLang server with "
                "return_logprob support is needed."
            )
        out: list[float] = [0.0]
        for t, entry in enumerate(entries[1:], start=1):
            logp, tok = entry[0], entry[1]
            if tok != token_ids[t]:
                raise RLError(
                    f"teacher: {url} scored token {tok} at position {t} where {token_ids[t]} was "
                    "sent; the server re-tokenised the input."
                )
            out.append(float(logp))
        return out

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs ``[T]`` of ``batch.tokens`` under the teacher (no entropy)."""
        if with_entropy:
            raise ConfigError("teacher: an SGLang teacher returns log-probs only, no entropy.")
        cu = batch.cu_seqlens.tolist()
        tokens = batch.tokens.tolist()
        seqs = [tokens[a:b] for a, b in itertools.pairwise(cu)]
        with concurrent.futures.ThreadPoolExecutor(self.config.concurrency) as pool:
            scored: list[Any] = list(pool.map(self._score, seqs))
        flat = [x for s in scored for x in s]
        logp_T = torch.tensor(flat, dtype=torch.float32, device=batch.tokens.device)
        return LogProbOutput(logprobs=logp_T, entropy=None, routed_experts=None)
