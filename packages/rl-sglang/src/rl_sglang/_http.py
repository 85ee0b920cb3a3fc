"""HTTP helpers of :class:`~rl_sglang.generator.SGLangGenerator`: GET/POST and control calls."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from rl_core.errors import GenerationError, WeightSyncError
from rl_sglang._state import _GeneratorState, _Server

log = logging.getLogger("rl_sglang.generator")  # the generator's logger, as before the split


class _HTTPMixin(_GeneratorState):
    """GET/POST to a server on the IO loop; control calls that must succeed."""

    async def _get_json(self, s: _Server, path: str, *, timeout: float) -> Any:
        assert self._io.session is not None
        async with self._io.session.get(
            s.url + path, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                raise GenerationError(f"GET {s.url}{path}: HTTP {resp.status} {await resp.text()}")
            return await resp.json(content_type=None)

    async def _post(
        self, url: str, path: str, body: dict[str, Any], *, timeout: float = 300.0
    ) -> tuple[int, Any]:
        assert self._io.session is not None
        async with self._io.session.post(
            url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            text = await resp.text()
            try:
                data = json.loads(text) if text else None
            except ValueError:
                data = text
            return resp.status, data

    async def _control(self, s: _Server, path: str, body: dict[str, Any]) -> Any:
        """POST a control call that must succeed (``success: false`` raises WeightSyncError).

        A write into a pooled connection the server had just closed (``ClientOSError``, e.g.
        broken pipe: the request never reached the server) is retried on a fresh connection.
        """
        for attempt in range(3):
            try:
                status, data = await self._post(s.url, path, body)
                break
            except aiohttp.ClientOSError:
                if attempt == 2 or (s.proc is not None and not s.proc.alive()):
                    raise
                await asyncio.sleep(0.2)
        ok = status == 200 and not (isinstance(data, dict) and data.get("success") is False)
        if not ok:
            msg = data.get("message", data) if isinstance(data, dict) else data
            raise WeightSyncError(f"{s.url}{path} failed (HTTP {status}): {msg}")
        return data

    async def _set_version(self, s: _Server, version: int) -> None:
        await self._control(
            s, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
        )
