"""Build steps shared by the trainer and ``rl-train check``: where the model and tokenizer come
from, which data sources a recipe names, and run-wide defaults for component options.

``rl-train check`` uses them to see a recipe exactly as the trainer will, without building the
policy or the generator::

    cfg = load_trainer_config("recipe.yaml")
    tok = load_tokenizer(cfg)                          # no model weights are built
    task = build_task(cfg)                             # None without ``task``
    train_spec, eval_spec = data_specs(cfg, task, data_dir=cfg.run_path / "data")
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from rl_core import registry
from rl_core.config import ComponentSpec, from_dict
from rl_core.errors import ConfigError
from rl_trainer.config import TrainerConfig

__all__ = [
    "BACKENDS",
    "backend_spec",
    "build_callable",
    "build_task",
    "component_name",
    "config_fields",
    "data_specs",
    "init_model_path",
    "load_tokenizer",
    "transport_spec",
    "validate_backends",
    "validate_spec",
    "with_defaults",
]


def init_model_path(cfg: TrainerConfig) -> str:
    """The initial model directory: ``model.path``, or the tiny model of ``model.init`` built
    into ``<run_dir>/init_model`` (once; an existing one is reused)."""
    if cfg.model.path:
        return cfg.model.path
    from rl_hf.tiny import TinyModelSpec, build_tiny_model

    path = cfg.run_path / "init_model"
    if not (path / "config.json").exists():
        spec = from_dict(
            TinyModelSpec, {"seed": cfg.seed, **(cfg.model.init or {})}, path="model.init"
        )
        build_tiny_model(path, spec)
        from rl_trainer.lifecycle.checkpoint import match_umask

        match_umask(path)  # safetensors writes 0600; the run's files share the umask's mode
    return str(path)


def load_tokenizer(cfg: TrainerConfig) -> Any:
    """The tokenizer the trainer will use, without building model weights.

    ``model.path``: its tokenizer. ``model.init``: the one already in ``<run_dir>/init_model``
    if a run built it, else the tiny models' tokenizer saved to a scratch directory and loaded
    back the way the trainer loads it (``AutoTokenizer.from_pretrained``).
    """
    from transformers import AutoTokenizer

    if cfg.model.path:
        path = Path(cfg.model.path)
        if not path.exists():
            raise ConfigError(
                f"model.path: {cfg.model.path} does not exist; point it at a Hugging Face model "
                "directory (config.json, tokenizer files) or use model.init for a tiny model."
            )
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model.path: no tokenizer could be loaded from {path} ({e}); the directory "
                "needs the tokenizer files (tokenizer.json / tokenizer_config.json)."
            ) from None
    from rl_hf.tiny import TinyModelSpec

    from_dict(TinyModelSpec, {"seed": cfg.seed, **(cfg.model.init or {})}, path="model.init")
    built = cfg.run_path / "init_model"
    if (built / "config.json").exists():
        return AutoTokenizer.from_pretrained(str(built))
    from rl_hf.tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory(prefix="rl-tokenizer-") as tmp:
        build_tokenizer(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def config_fields(kind: str, spec: ComponentSpec) -> set[str]:
    """Option names of the ``Config`` of the component ``spec`` names (empty if it has none)."""
    cls = registry.resolve(registry.GROUPS[kind], spec.type, field=f"{kind}.type")
    return {f.name for f in dataclasses.fields(cls.Config)} if hasattr(cls, "Config") else set()


def with_defaults(kind: str, spec: ComponentSpec, **defaults: Any) -> ComponentSpec:
    """``spec`` with run-wide defaults (model path, seed) for the options its ``Config`` has;
    options the recipe sets win."""
    known = config_fields(kind, spec)
    return ComponentSpec(
        type=spec.type,
        options={**{k: v for k, v in defaults.items() if k in known}, **spec.options},
    )


def build_task(cfg: TrainerConfig) -> Any:
    """The built-in task of ``cfg.task`` (``None`` when the recipe sets none)."""
    return registry.build("task", cfg.task, field="task") if cfg.task is not None else None


def data_specs(
    cfg: TrainerConfig, task: Any, *, data_dir: Path
) -> tuple[ComponentSpec, ComponentSpec | None]:
    """The train and eval prompt sources: ``data.train``/``data.eval``, else the task's splits
    (written to ``data_dir``). The train spec gets the run seed when its ``Config`` has one."""
    train_spec, eval_spec = cfg.data.train, cfg.data.eval
    if task is not None:
        paths = task.write_splits(data_dir)
        train_spec = train_spec or ComponentSpec(
            type="jsonl", options={"path": str(paths["train"]), "shuffle": True}
        )
        eval_spec = eval_spec or ComponentSpec(
            type="jsonl", options={"path": str(paths["eval"]), "shuffle": False}
        )
    if train_spec is None:
        raise ConfigError("data.train: set a prompt source (or a built-in task).")
    return with_defaults("data_source", train_spec, seed=cfg.seed), eval_spec


def build_callable(kind: str, spec: ComponentSpec, protocol: type, *, field: str) -> Any:
    """Build a function seam (a reward, group reward, filter or ``generate_fn``) named by
    ``spec`` and check now that it can be called the way the trainer calls ``protocol``
    (:func:`rl_core.registry.check_callable`), so a wrong signature fails at start-up."""
    fn = registry.build(kind, spec, field=field)
    fn = registry.check_callable(fn, protocol, field=field, ref=spec.type)
    if kind == "generate_fn":  # it must be awaitable (rl_buffer.rollout.check_generate_fn)
        from rl_buffer.rollout import check_generate_fn

        check_generate_fn(fn, field=field, ref=spec.type)
    return fn


def component_name(field: str, spec: ComponentSpec | None) -> str:
    """How failure reports name a component: its config field and type."""
    return f"{field} (type {spec.type!r})" if spec is not None else field


def transport_spec(cfg: TrainerConfig, start_path: str) -> ComponentSpec:
    """The weight transport's spec with run-local defaults: sync directories under the run, the
    RL start checkpoint as the delta base and as the source of config/tokenizer files, and the
    sender's place (rank 0 of 2) for a collective transport."""
    return with_defaults(
        "weight_transport",
        cfg.weight_transport,
        directory=str(cfg.run_path / "weights"),
        local_dir=str(cfg.run_path / "weights_local"),
        base_checkpoint=start_path,
        assets_dir=start_path,
        rank=0,
        world_size=2,
    )


BACKENDS = ("policy", "generator", "weight_transport")
"""The components whose options are validated at start-up (:func:`validate_backends`)."""


def backend_spec(cfg: TrainerConfig, kind: str, model_path: str) -> ComponentSpec:
    """The spec of the backend ``kind`` (one of :data:`BACKENDS`) with the run-wide defaults it
    is validated with (``model_path``: the initial model)."""
    spec = transport_spec(cfg, model_path) if kind == "weight_transport" else getattr(cfg, kind)
    return with_defaults(kind, spec, model_path=model_path)


def validate_backends(cfg: TrainerConfig, model_path: str) -> None:
    """Resolve the policy, generator and weight transport and validate their options now, before
    any work: a typo fails at start-up with a :class:`~rl_core.errors.ConfigError`."""
    for kind in BACKENDS:
        validate_spec(kind, backend_spec(cfg, kind, model_path))
    gen_cls = registry.resolve(registry.GROUPS["generator"], cfg.generator.type, field="generator")
    count = cfg.runtime.generator.count
    if cfg.runtime.type == "ray" and count > 0 and getattr(gen_cls, "one_per_run", False):
        raise ConfigError(
            f"runtime.generator.count: {count} engine actors would each start generator type "
            f"{cfg.generator.type!r}, which launches and owns all of its server groups itself; "
            "set runtime.generator.count: 0 (it runs in the driver) and a file weight transport "
            "(disk_full / disk_delta)."
        )


def validate_spec(kind: str, spec: ComponentSpec) -> None:
    """Resolve ``spec`` in the registry group ``kind`` and validate its options against the
    component's ``Config`` (when it has one)."""
    cls = registry.resolve(registry.GROUPS[kind], spec.type, field=f"{kind}.type")
    if hasattr(cls, "Config"):
        from_dict(cls.Config, spec.options, path=kind)
