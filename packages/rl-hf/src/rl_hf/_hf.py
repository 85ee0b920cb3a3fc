"""Private helpers shared by the Hugging Face reference backends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["quiet_progress"]


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence transformers' load/save progress bars inside the block, then restore them."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
