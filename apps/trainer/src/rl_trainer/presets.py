"""Algorithm presets: named partial configs applied as an overlay under a recipe.

A preset (``presets/<name>.yaml``) holds only what makes an algorithm what it is: the
``algorithm`` section, the ``rollout`` filters / over-sampling / overlong shaping, the ``rl``
update settings, and, where the algorithm needs one, a ``critic`` or ``teacher``. It is applied
on any recipe, ``rl-train run my.yaml --preset dapo`` or ``preset: dapo`` in the recipe::

    merged = deep_merge(preset, recipe)      # the recipe's own values win over the preset's
    config = merged + --set overrides        # and --set wins over both

A recipe may also ``extends:`` another recipe (a bundled name such as ``demo``, or a path
relative to the recipe): the base is below the preset and the extending file's own values are
above it (``base < preset < recipe < --set``), so ``recipes/dapo.yaml`` is just
``extends: demo`` + ``preset: dapo``: the demo's task and model with DAPO's algorithm.

``rl-train check`` prints the merged sections and which preset values the recipe replaced;
``rl-train recipes`` lists the examples and the presets apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from rl_core.config import load_config_file
from rl_core.errors import ConfigError

__all__ = [
    "PRESET_SECTIONS",
    "apply_preset",
    "bundled_recipe",
    "deep_merge",
    "list_examples",
    "list_presets",
    "load_preset",
    "preset_override",
    "resolve_recipe_data",
    "shadowed_keys",
]

PRESET_SECTIONS = ("algorithm", "rollout", "rl", "critic", "teacher")
"""The top-level sections a preset may set; anything else (task, model, run_dir, ...) belongs
to the recipe."""


def _folder(name: str) -> Any:
    return resources.files("rl_trainer") / name


def list_presets() -> list[str]:
    """The names of the bundled presets (``presets/*.yaml``), sorted."""
    return sorted(
        f.name.removesuffix(".yaml")
        for f in _folder("presets").iterdir()
        if f.name.endswith(".yaml")
    )


def list_examples(*, overlays: bool = False) -> list[str]:
    """The names of the bundled example recipes (``recipes/*.yaml``), sorted; without
    ``overlays`` the recipes named after a preset (``recipes/dapo.yaml``: the demo under the
    ``dapo`` preset) are left out."""
    presets = set() if overlays else set(list_presets())
    names = (
        f.name.removesuffix(".yaml")
        for f in _folder("recipes").iterdir()
        if f.name.endswith(".yaml")
    )
    return sorted(n for n in names if n not in presets)


def bundled_recipe(name: str) -> Path | None:
    """The path of the bundled recipe ``name`` (``demo`` -> ``recipes/demo.yaml``), or ``None``."""
    f = _folder("recipes") / f"{name}.yaml"
    return Path(str(f)) if f.is_file() else None


def load_preset(name: str) -> dict[str, Any]:
    """The partial config of preset ``name``.

    Raises:
        ConfigError: no preset of that name (the message lists the known ones), or the preset
            file sets a section a preset may not set.
    """
    known = list_presets()
    if not isinstance(name, str) or name not in known:
        raise ConfigError(
            f"preset: unknown preset {name!r}; known presets: {', '.join(known)} "
            "(rl-train recipes lists them)."
        )
    path = Path(str(_folder("presets") / f"{name}.yaml"))
    data = load_config_file(path)
    extra = sorted(set(data) - set(PRESET_SECTIONS))
    if extra:
        raise ConfigError(
            f"{path}: a preset sets only {', '.join(PRESET_SECTIONS)}; remove {', '.join(extra)}."
        )
    return data


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top: tables merge key by key, any other value of ``over``
    (a scalar, a list, ``null``) replaces ``base``'s. Neither input is modified."""
    out: dict[str, Any] = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def shadowed_keys(
    preset: Mapping[str, Any], recipe: Mapping[str, Any], prefix: str = ""
) -> list[str]:
    """Dotted keys the preset sets that ``recipe`` sets to another value (the recipe wins)."""
    out = []
    for key, value in preset.items():
        if key not in recipe:
            continue
        name = f"{prefix}{key}"
        mine = recipe[key]
        if isinstance(value, Mapping) and isinstance(mine, Mapping):
            out += shadowed_keys(value, mine, name + ".")
        elif mine != value:
            out.append(name)
    return out


def apply_preset(recipe: Mapping[str, Any], name: str | None) -> dict[str, Any]:
    """``recipe`` over preset ``name`` (the recipe's values win); ``recipe`` when ``name`` is
    ``None``. The ``preset`` key is kept, so the run's stored config names it."""
    if name is None:
        return dict(recipe)
    return deep_merge(load_preset(name), recipe)


def _extends_path(ref: Any, where: Path | None) -> Path:
    """The file an ``extends:`` value names: a path (relative to the recipe) or a bundled name."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError(
            f"extends: {ref!r} is not a recipe; give a bundled recipe name (e.g. demo) or a path."
        )
    if where is not None and (where / ref).is_file():
        return where / ref
    if Path(ref).is_file():
        return Path(ref)
    bundled = bundled_recipe(ref)
    if bundled is None:
        raise ConfigError(
            f"extends: {ref!r}: no such file beside the recipe and no bundled recipe of that "
            f"name (bundled: {', '.join(list_examples(overlays=True))})."
        )
    return bundled


def resolve_recipe_data(
    data: Mapping[str, Any],
    *,
    where: Path | None = None,
    preset: str | None = None,
    _seen: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """A recipe's data with its ``extends:`` base and its preset applied.

    ``base < preset < the recipe's own values``; ``preset`` (from ``--preset`` or ``--set
    preset=...``) replaces the recipe's ``preset:`` field. ``where`` is the recipe file's
    directory (for a relative ``extends:``)."""
    own = dict(data)
    ref = own.pop("extends", None)
    base: dict[str, Any] = {}
    if ref is not None:
        path = _extends_path(ref, where).resolve()
        if path in _seen:
            raise ConfigError(
                f"extends: {path} extends itself (through {_seen[-1]}); remove the loop."
            )
        base = resolve_recipe_data(load_config_file(path), where=path.parent, _seen=(*_seen, path))
    name = preset if preset is not None else own.get("preset")
    if name is not None:
        own["preset"] = name
    merged = deep_merge(base, load_preset(name)) if name is not None else base
    return deep_merge(merged, own)


def preset_override(overrides: list[str] | tuple[str, ...]) -> str | None:
    """The preset an ``--set preset=NAME`` override names (the last one wins), or ``None``."""
    from rl_core.config import parse_override

    name = None
    for text in overrides:
        keys, value = parse_override(text)
        if keys == ["preset"]:
            name = value
    return name
