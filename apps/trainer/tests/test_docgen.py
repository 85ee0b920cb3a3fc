"""The generated configuration reference is made of whole sentences."""

from __future__ import annotations

import dataclasses
import typing

from rl_trainer import config as config_module
from rl_trainer.docgen import class_summary, field_docs, render

_END = (".", "?", "!")


def _config_classes() -> list[type]:
    return [
        obj
        for obj in vars(config_module).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == config_module.__name__
    ]


def test_every_config_field_has_a_whole_sentence():
    """Each field's description and each section's summary ends a sentence (nothing cut at a
    line break or a period), and no field lacks one."""
    classes = _config_classes()
    assert config_module.EvalConfig in classes and config_module.RuntimeConfig in classes
    cut = []
    for cls in classes:
        summary = class_summary(cls)
        if not summary.endswith(_END):
            cut.append(f"{cls.__name__}: {summary!r}")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name in hints
            text = docs.get(f.name, "")
            if not text.endswith(_END):
                cut.append(f"{cls.__name__}.{f.name}: {text!r}")
    assert not cut, cut


def test_rendered_sections_keep_their_whole_summary():
    doc = render()
    assert (
        "Evaluation on the held-out prompts (the task's eval split or ``data.eval``) and on any "
        "extra ``datasets``." in doc
    )
    for line in doc.splitlines():
        if line.startswith("| `"):
            assert line.removesuffix(" |").endswith(_END), line
