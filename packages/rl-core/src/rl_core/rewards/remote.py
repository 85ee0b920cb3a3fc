"""A reward model (or verifier) behind HTTP.

:class:`RemoteReward` POSTs one JSON document per rollout to ``Config.url``::

    {"prompt": <Prompt.input>, "response": "<decoded response>", "label": <Prompt.label>,
     "prompt_uid": "...", "sample_id": "...", "metadata": {<Prompt.metadata>}}

and expects a JSON answer: a number, or an object holding ``Config.reward_key`` (other numeric
fields of the object are returned too, as logged components). The call is async (the standard
library's ``urllib`` in a worker thread via :func:`asyncio.to_thread`), so the trainer scores
other rollouts meanwhile; no HTTP client dependency.

Bounds: ``timeout_seconds`` is a deadline on the whole of one attempt (connect, headers and
body together), not a per-read timeout, so a server that trickles one byte a second cannot
hold a call past it; ``max_response_bytes`` caps the answer (a larger ``Content-Length`` is
refused before the body is read, and a body without one is read at most that far).

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
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rl_core.config import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt
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
        """Deadline of one HTTP attempt: connect, send and read the whole answer (a total,
        not a per-read timeout)."""
        max_response_bytes: PositiveInt = 16 * 1024 * 1024
        """Largest answer accepted (16 MiB); a larger one fails the call without being read
        whole."""
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
            if self.max_response_bytes < 1:
                raise ConfigError(
                    f"reward.max_response_bytes: must be >= 1, got {self.max_response_bytes}."
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
                # The thread enforces the deadline itself; the wait is a backstop (a thread
                # blocked past it is left to its socket timeout, never awaited).
                status, text = await asyncio.wait_for(
                    asyncio.to_thread(self._post, body, where), c.timeout_seconds + 1.0
                )
            except _Retryable as e:
                last = str(e)
                continue
            except TimeoutError:
                last = f"no complete answer within the {c.timeout_seconds} s deadline"
                continue
            return self._parse(status, text, where)
        raise RewardError(
            f"{where}: failed after {c.max_retries + 1} attempts; last error: {last}. Check that "
            "the service is up, or raise reward.timeout_seconds / reward.max_retries."
        )

    def _post(self, body: bytes, where: str = "remote reward") -> tuple[int, str]:
        """One attempt: ``(status, text)``; :class:`_Retryable` on a network failure or when
        the deadline passes; :class:`RewardError` for an answer over the size cap."""
        c = self.config
        deadline = time.monotonic() + c.timeout_seconds
        req = urllib.request.Request(
            c.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json", **c.headers},
        )
        try:
            with urllib.request.urlopen(req, timeout=c.timeout_seconds) as resp:
                return resp.status, self._read(resp, deadline, where)
        except urllib.error.HTTPError as e:
            try:
                text = self._read(e, deadline, where, limit=4096)[:200]
            except (_Retryable, RewardError, OSError):
                text = ""
            if e.code in _RETRY_STATUS:
                raise _Retryable(f"HTTP {e.code}: {text}") from None
            return e.code, text
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None

    def _read(self, resp: Any, deadline: float, where: str, limit: int | None = None) -> str:
        """The body of ``resp``, read in chunks until ``deadline`` and at most the size cap
        (``limit`` bytes instead, for an error page, which is cut there silently)."""
        cap = self.config.max_response_bytes
        length = resp.headers.get("Content-Length") if resp.headers is not None else None
        numeric = length is not None and length.strip().isdigit()
        if limit is None and numeric and int(length) > cap:
            raise RewardError(
                f"{where}: the answer is {int(length)} bytes (Content-Length), over "
                f"reward.max_response_bytes = {cap}; the service must answer with a small "
                "JSON document, or raise reward.max_response_bytes."
            )
        sock = _socket_of(resp)
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Retryable(
                    f"timed out: no complete answer within the {self.config.timeout_seconds} s "
                    f"deadline ({size} bytes received)"
                )
            if sock is not None:
                sock.settimeout(left)
            try:
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
            except TimeoutError:
                continue  # the deadline check above raises
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size >= limit:
                break
            if limit is None and size > cap:
                raise RewardError(
                    f"{where}: the answer passed reward.max_response_bytes = {cap} bytes; "
                    "the service must answer with a small JSON document, or raise "
                    "reward.max_response_bytes."
                )
        return b"".join(chunks).decode("utf-8", errors="replace")

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


def _socket_of(resp: Any) -> socket.socket | None:
    """The socket under an ``http.client`` response (to set the time left before each read),
    or ``None`` when it cannot be reached (then each read waits at most ``timeout_seconds``)."""
    raw = getattr(getattr(resp, "fp", None), "raw", None)
    sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _finite(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(f"{where}: {what} is {value!r}; the reward must be a finite number.")
    return float(value)
