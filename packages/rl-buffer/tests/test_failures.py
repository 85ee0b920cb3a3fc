"""Failure accounting (:mod:`rl_buffer.failures`): the cause of a failure of user code is located
at the user's own line, not in the library it called."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from rl_buffer.failures import user_frame


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A function ``(name, source) -> Path``: writes ``<name>.py`` (dedented) to an importable
    directory, as a user's reward module would be; removed from ``sys.modules`` afterwards."""
    code_dir = tmp_path / "user_code"
    code_dir.mkdir()
    monkeypatch.syspath_prepend(str(code_dir))
    names = []

    def write(name: str, source: str) -> Path:
        path = code_dir / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        names.append(name)
        return path

    yield write
    for name in names:
        sys.modules.pop(name, None)


def _line_of(path: Path, text: str) -> int:
    """The 1-based line of ``path`` holding ``text``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_user_frame_is_the_users_line_not_the_library_it_called(user_module):
    path = user_module(
        "ucf_frame",
        """
        import json

        def score(text):
            return json.loads(text)
        """,
    )
    import ucf_frame

    with pytest.raises(ValueError) as info:
        ucf_frame.score("{not json")
    frame = user_frame(info.value)
    assert (frame.filename, frame.lineno) == (str(path), _line_of(path, "json.loads"))
