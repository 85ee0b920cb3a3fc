"""A reward model (or verifier) behind HTTP.

:class:`RemoteReward` POSTs one JSON document per rollout to ``Config.url``::

    {"prompt": <Prompt.input>, "response": "<decoded response>", "label": <Prompt.label>,
     "prompt_uid": "...", "sample_id": "...", "metadata": {<Prompt.metadata>}}

and expects a JSON answer: a number, or an object holding ``Config.reward_key`` (other numeric
fields of the object are returned too, as logged components). The call is async (the standard
library's ``urllib`` in a worker thread via :func:`asyncio.to_thread`), so the trainer scores
other rollouts meanwhile; no HTTP client dependency.

Failures: connection errors, timeouts, HTTP 429 and 5xx are retried ``max_retries`` times with
exponential backoff (``backoff_seconds * 2**attempt``, capped at ``max_backoff_seconds``). Other
non-200 statuses, a body that is not JSON, or a missing / non-numeric reward key raise
:class:`~rl_core.errors.RewardError` at once; so does the last failed retry. The trainer then
marks that rollout failed and counts the reason; the step goes on.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rl_core.config import NonNegFloat, NonNegInt, PositiveFloat
from rl_core.errors import ConfigError, RewardError
from rl_core.types import Prompt, Rollout

__all__ = ["RemoteReward"]

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class _Retryable(Exception):
    pass


class RemoteReward:
    """Scores a rollout by POSTing it to an HTTP reward service (see the module docstring).

    Registered as ``remote``. Async: returns a coroutine of ``{"reward": float, ...}``.
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`RemoteReward`."""

        url: str
        """Endpoint, ``http://`` or ``https://`` (e.g. ``http://127.0.0.1:8000/score``)."""
        timeout_seconds: PositiveFloat = 30.0
        """Time limit of one HTTP attempt (connect + read)."""
        max_retries: NonNegInt = 3
        """Extra attempts after a retryable failure (0: try once)."""
        backoff_seconds: NonNegFloat = 0.5
        """Wait before the first retry; doubles each retry."""
        max_backoff_seconds: NonNegFloat = 8.0
        """Upper bound on one wait."""
        reward_key: str = "reward"
        """Key of the reward in the service's JSON object."""
        headers: dict[str, str] = field(default_factory=dict)
        """Extra request headers (e.g. ``Authorization``)."""

        def __post_init__(self) -> None:
            scheme = urllib.parse.urlparse(self.url).scheme
            if scheme not in ("http", "https"):
                raise ConfigError(
                    f"reward.url: {self.url!r} is not an http(s) URL; give e.g. "
                    "'http://127.0.0.1:8000/score'."
                )
            if not self.timeout_seconds > 0:
                raise ConfigError(
                    f"reward.timeout_seconds: must be > 0, got {self.timeout_seconds}."
                )
            if self.max_retries < 0:
                raise ConfigError(f"reward.max_retries: must be >= 0, got {self.max_retries}.")
            if self.backoff_seconds < 0 or self.max_backoff_seconds < 0:
                raise ConfigError("reward.backoff_seconds / max_backoff_seconds: must be >= 0.")

    def __init__(self, config: Config) -> None:
        self.config = config

    def payload(self, prompt: Prompt, response: str, rollout: Rollout | None) -> dict[str, Any]:
        """The JSON document sent for one rollout (override to change the wire format)."""
        return {
            "prompt": getattr(prompt, "input", None),
            "response": response,
            "label": getattr(prompt, "label", None),
            "prompt_uid": getattr(prompt, "uid", None),
            "sample_id": getattr(rollout, "sample_id", None),
            "metadata": getattr(prompt, "metadata", None) or {},
        }

    async def __call__(
        self, prompt: Prompt, response: str, rollout: Rollout | None = None
    ) -> dict[str, float]:
        """POST the rollout and return ``{"reward": ..., <other numeric fields>}``."""
        body = json.dumps(self.payload(prompt, response, rollout), default=str).encode()
        c = self.config
        where = f"remote reward {c.url} (sample {getattr(rollout, 'sample_id', '?')})"
        last = ""
        for attempt in range(c.max_retries + 1):
            if attempt:
                await asyncio.sleep(
                    min(c.backoff_seconds * 2 ** (attempt - 1), c.max_backoff_seconds)
                )
            try:
                status, text = await asyncio.to_thread(self._post, body)
            except _Retryable as e:
                last = str(e)
                continue
            return self._parse(status, text, where)
        raise RewardError(
            f"{where}: failed after {c.max_retries + 1} attempts; last error: {last}. Check that "
            "the service is up, or raise reward.timeout_seconds / reward.max_retries."
        )

    def _post(self, body: bytes) -> tuple[int, str]:
        c = self.config
        req = urllib.request.Request(
            c.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json", **c.headers},
        )
        try:
            with urllib.request.urlopen(req, timeout=c.timeout_seconds) as resp:
                return resp.status, resp.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")[:200]
            if e.code in _RETRY_STATUS:
                raise _Retryable(f"HTTP {e.code}: {text}") from None
            return e.code, text
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None

    def _parse(self, status: int, text: str, where: str) -> dict[str, float]:
        key = self.config.reward_key
        if status != 200:
            raise RewardError(
                f"{where}: HTTP {status}: {text[:200]!r}; fix the request or the service "
                "(only 408, 429 and 5xx are retried)."
            )
        try:
            data = json.loads(text)
        except ValueError:
            raise RewardError(
                f"{where}: the answer is not JSON: {text[:200]!r}; the service must return a "
                f'number or an object like {{"{key}": 1.0}}.'
            ) from None
        if isinstance(data, bool) or not isinstance(data, int | float | Mapping):
            raise RewardError(
                f"{where}: expected a number or a JSON object, got {type(data).__name__}."
            )
        if not isinstance(data, Mapping):
            return {"reward": _finite(data, where, "the answer")}
        if key not in data:
            raise RewardError(
                f"{where}: the JSON answer has no {key!r} key (keys: {sorted(data)}); set "
                "reward.reward_key to the key the service uses."
            )
        out = {
            str(k): float(v)
            for k, v in data.items()
            if k != key and isinstance(v, int | float) and not isinstance(v, bool)
        }
        out["reward"] = _finite(data[key], where, repr(key))
        return out


def _finite(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(f"{where}: {what} is {value!r}; the reward must be a finite number.")
    return float(value)
