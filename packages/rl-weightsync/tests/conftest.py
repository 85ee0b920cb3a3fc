"""Shared fixtures of the rl-weightsync tests: editing a published manifest as a buggy sender
would (the edit is re-signed, so only the checks past the manifest's own checksum can catch it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rl_weightsync.manifest import sign

EditFn = Callable[[Path, Callable[[dict[str, Any]], None]], None]


def resign_manifest(vdir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to ``vdir/manifest.json`` (a dict without ``manifest_checksum``), then write
    it back with a matching checksum."""
    path = vdir / "manifest.json"
    raw = json.loads(path.read_text())
    raw.pop("manifest_checksum")
    edit(raw)
    raw["manifest_checksum"] = sign(raw)
    path.write_text(json.dumps(raw))


@pytest.fixture
def edit_manifest() -> EditFn:
    """:func:`resign_manifest`."""
    return resign_manifest
