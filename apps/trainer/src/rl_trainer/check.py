"""``rl-train check``: a dry run of a recipe in seconds, before any weights are built.

It does what the trainer does up to the first generation, and stops there:

1. loads the recipe (with ``--set`` overrides) and validates every component's options
   (policy, generator, weight transport, buffer, filters, rollout, group reward, algorithm);
2. loads the tokenizer the run will use (``model.init`` builds no weights);
3. builds every data source (train, eval, each ``eval.datasets`` entry) with that tokenizer,
   through the registry as the trainer does, so every line of every file is read and checked;
4. draws a few prompts of each and decodes their token ids: the prompt exactly as the model
   will see it, chat template and special tokens included;
5. scores, with the reward of each set and the trainer's own :class:`~rl_buffer.scoring.Scorer`,
   two dummy responses (an empty one and a wrong answer) and the label answer (``str(label)``,
   the text the SFT warm-up trains toward);
6. with a ``rollout.generate_fn``, calls it once on a train prompt with a generator that ends
   every request at once (EOS): a function that raises or returns an empty list or something
   other than a list of ``Rollout`` is a problem now, not at the first round (a plain, not
   ``async``, function is refused when it is built, in ``check`` and ``run`` alike);
7. checks what the model cannot honour, as ``run`` does before building it
   (:mod:`rl_trainer.load_checks`): ``rollout.routing_replay`` on a dense model, and train
   prompts that with ``rollout.sampling.max_new_tokens`` pass the model's context (named by
   file and line).

Each finding is a *problem* (the run would fail or train on garbage: exit status 1) or a
*warning* (worth a look, exit status 0; ``--strict`` makes warnings fail too):

- problem: a config error, an unreadable or malformed data file, a reward that cannot be
  loaded, raises, or returns something that is not a finite number (or a mapping with a
  ``reward`` key), an SFT warm-up on rows without labels;
- warning: a label answer scoring below the set's correct threshold
  (``eval.correct_threshold``, default 1.0). A warning, not a problem, because many rewards
  expect a format the bare label lacks (``\\boxed{42}``, ``#### 42``) or labels that are not
  the answer text (test cases); a dummy response scoring at or above the threshold is a warning
  too (the reward may give credit for nothing).

Every finding names the field or file at fault and says how to fix it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl_buffer.failures import RolloutStats
from rl_buffer.scoring import Scorer
from rl_core import registry
from rl_core.config import ComponentSpec, from_dict, to_dict
from rl_core.errors import RLError
from rl_core.interfaces import GenerateFn, GroupFilter, GroupRewardFn, RewardFn
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Group,
    Prompt,
    Rollout,
    RolloutStatus,
)
from rl_trainer.build import (
    BACKENDS,
    backend_spec,
    build_callable,
    build_task,
    data_specs,
    load_tokenizer,
    validate_spec,
)
from rl_trainer.config import TrainerConfig, load_trainer_config
from rl_trainer.defaults import auto_choices
from rl_trainer.presets import PRESET_SECTIONS, load_preset, shadowed_keys

__all__ = ["DUMMY_RESPONSES", "CheckReport", "Finding", "SampleRow", "check_recipe", "print_report"]

DUMMY_RESPONSES: dict[str, str] = {"empty": "", "wrong": "I think the answer is 42."}
"""Responses every reward must score without raising, by column name: an empty one (a model
that stops at once) and a plausible wrong answer."""


@dataclass(kw_only=True, slots=True)
class Finding:
    """One thing ``check`` found."""

    level: Literal["problem", "warning", "note"]
    """``problem``: the run would fail or learn nothing (exit status 1); ``warning``: worth a
    look; ``note``: what check did not do and why (never fails the check)."""
    where: str
    """The config field, ``file:line`` or data set at fault."""
    message: str
    """What is wrong and how to fix it."""


@dataclass(kw_only=True, slots=True)
class SampleRow:
    """One prompt as the model will see it, with the rewards of the test responses."""

    set_name: str
    """``train``, ``eval`` or ``eval/<name>``."""
    uid: str
    """The prompt's uid."""
    prompt_text: str
    """The prompt's token ids decoded with special tokens kept: the exact model input."""
    num_tokens: int
    """Prompt length in tokens."""
    label: str | None
    """The label answer (``str(label)``), ``None`` if the row has no label."""
    dummy_rewards: list[float | None]
    """Reward of each of :data:`DUMMY_RESPONSES`, in order (``None``: the reward failed)."""
    label_reward: float | None
    """Reward of the label answer (``None``: no label, or the reward failed)."""


@dataclass(kw_only=True, slots=True)
class CheckReport:
    """What ``check`` found: the findings and the sample rows it rendered."""

    recipe: str
    """The recipe checked."""
    findings: list[Finding] = field(default_factory=list)
    """Problems and warnings, in the order found."""
    rows: list[SampleRow] = field(default_factory=list)
    """Sample prompts of every data set."""
    preset: str | None = None
    """The algorithm preset applied under the recipe (``preset:`` or ``--preset``), if any."""
    merged: dict[str, Any] = field(default_factory=dict)
    """With a preset: the sections a preset may set (``algorithm``, ``rollout``, ``rl``,
    ``critic``, ``teacher``) of the merged config, as plain data."""
    replaced: list[str] = field(default_factory=list)
    """With a preset: the dotted keys the preset sets whose value the recipe (or ``--set``)
    replaced."""
    chosen: list[str] = field(default_factory=list)
    """The settings the trainer chooses because the recipe leaves them open, each with its
    reason (:func:`rl_trainer.defaults.auto_choices`)."""

    @property
    def problems(self) -> list[Finding]:
        """The findings that fail the check."""
        return [f for f in self.findings if f.level == "problem"]

    @property
    def warnings(self) -> list[Finding]:
        """The findings that do not fail the check (unless ``--strict``)."""
        return [f for f in self.findings if f.level == "warning"]

    def problem(self, where: str, message: str) -> None:
        """Record a problem."""
        self.findings.append(Finding(level="problem", where=where, message=message))

    def warning(self, where: str, message: str) -> None:
        """Record a warning."""
        self.findings.append(Finding(level="warning", where=where, message=message))

    def note(self, where: str, message: str) -> None:
        """Record a note (a probe skipped, with the reason)."""
        self.findings.append(Finding(level="note", where=where, message=message))


def _user_frame(e: BaseException) -> str:
    """``file:line`` of the innermost frame of ``e``'s traceback (where user code failed)."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _attempt(report: CheckReport, where: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run ``fn``; an error becomes a problem at ``where``. Returns ``(ok, result)``."""
    try:
        return True, fn()
    except RLError as e:
        report.problem(where, str(e))
    except Exception as e:  # user code (a reward module, a data source) may raise anything
        report.problem(
            where,
            f"{type(e).__name__}: {e} (raised at {_user_frame(e)}); fix the code there or the "
            "config that names it.",
        )
    return False, None


class _Recorder:
    """Wraps a reward function to keep what it raised or returned, for the error message."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.error: BaseException | None = None
        self.value: Any = None

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> Any:
        self.error, self.value = None, None
        try:
            value = self.fn(prompt, response, rollout)
        except Exception as e:
            self.error = e
            raise
        if inspect.isawaitable(value):
            return self._await(value)
        self.value = value
        return value

    async def _await(self, awaitable: Any) -> Any:
        try:
            self.value = await awaitable
        except Exception as e:
            self.error = e
            raise
        return self.value


@dataclass(kw_only=True, slots=True)
class _EvalTarget:
    """One data set to sample: its source spec, reward and correct threshold."""

    set_name: str
    field: str
    spec: ComponentSpec
    reward: Any
    reward_field: str
    threshold: float


def _response_rollout(prompt: Prompt, tokenizer: Any, text: str) -> Rollout:
    """A completed rollout answering ``prompt`` with ``text`` (then EOS, as a model ends)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    n = len(ids)
    return Rollout(
        prompt_uid=prompt.uid,
        rollout_id=f"{prompt.uid}/check",
        sample_id=f"{prompt.uid}/check",
        tokens=tuple(prompt.token_ids) + tuple(ids),
        response_start=len(prompt.token_ids),
        loss_mask=(1,) * n,
        rollout_logprobs=(0.0,) * n,
        versions=(0,) * n,
    )


def _score(
    reward: _Recorder, scorer: Scorer, prompt: Prompt, text: str, tokenizer: Any
) -> tuple[float | None, str | None]:
    """Score ``text`` as the trainer would: ``(reward, None)`` or ``(None, what went wrong)``."""
    r = _response_rollout(prompt, tokenizer, text)
    asyncio.run(scorer.score([Group(prompt=prompt, rollouts=[r])], RolloutStats()))
    if r.status != RolloutStatus.FAILED:
        return r.reward, None
    if reward.error is not None:
        e = reward.error
        return None, (
            f"raised {type(e).__name__}: {e} (at {_user_frame(e)}) on the response {text!r}; "
            "a reward must return a number for any text the model may write (empty included)."
        )
    value = reward.value
    return None, (
        f"returned {value!r} ({type(value).__name__}) for the response {text!r}; return a finite "
        "float (or a mapping with a finite 'reward' entry). The trainer would mark every such "
        f"rollout failed ({r.metadata.get('failure', 'reward_invalid')})."
    )


def _label_text(label: Any) -> str | None:
    """The label as a response (what SFT trains toward), or ``None`` for structured labels."""
    if label is None or isinstance(label, dict | list | tuple):
        return None
    return str(label)


def _check_components(report: CheckReport, cfg: TrainerConfig, model_path: str) -> None:
    """Resolve every named component and validate its options, as the trainer's build does."""
    for kind in BACKENDS:
        # Each with the run-wide defaults the trainer gives it (build.backend_spec).

        def validate(kind: str = kind) -> None:
            validate_spec(kind, backend_spec(cfg, kind, model_path))

        _attempt(report, kind, validate)
    _attempt(report, "buffer", lambda: registry.build("buffer", cfg.buffer, field="buffer"))
    for i, f in enumerate(cfg.rollout.filters):
        where = f"rollout.filters[{i}]"
        _attempt(
            report,
            where,
            lambda f=f, where=where: build_callable("filter", f, GroupFilter, field=where),
        )
    if cfg.rollout.generate_fn is not None:
        _attempt(
            report,
            "rollout.generate_fn",
            lambda: build_callable(
                "generate_fn", cfg.rollout.generate_fn, GenerateFn, field="rollout.generate_fn"
            ),
        )
    if cfg.group_reward is not None:
        _attempt(
            report,
            "group_reward",
            lambda: build_callable("reward", cfg.group_reward, GroupRewardFn, field="group_reward"),
        )
    from rl_core.algorithms import ADVANTAGE_ESTIMATORS, PolicyLoss

    alg = cfg.algorithm
    if alg.advantage in ADVANTAGE_ESTIMATORS:
        est = ADVANTAGE_ESTIMATORS[alg.advantage]
        _attempt(
            report,
            "algorithm.advantage_options",
            lambda: from_dict(
                est.Config, alg.advantage_options, path="algorithm.advantage_options"
            ),
        )
    else:
        spec = ComponentSpec(type=alg.advantage, options=alg.advantage_options)
        _attempt(
            report,
            "algorithm.advantage",
            lambda: registry.build("advantage", spec, field="algorithm.advantage"),
        )
    ok, loss_cfg = _attempt(
        report,
        "algorithm.loss",
        lambda: from_dict(PolicyLoss.Config, alg.loss, path="algorithm.loss"),
    )
    if ok and loss_cfg.kl_coef > 0 and not alg.use_reference:
        report.problem(
            "algorithm.loss.kl_coef",
            "> 0 needs a reference model; set algorithm.use_reference: true or kl_coef: 0.",
        )


def _reward(report: CheckReport, spec: ComponentSpec, where: str) -> Any:
    """Build a reward function and check its signature; ``None`` (and a problem) on failure."""

    return _attempt(report, where, lambda: build_callable("reward", spec, RewardFn, field=where))[1]


def _targets(report: CheckReport, cfg: TrainerConfig, data_dir: Path) -> list[_EvalTarget]:
    """The data sets to sample: train, the default eval set, and each ``eval.datasets`` entry."""
    ok, task = _attempt(report, "task", lambda: build_task(cfg))
    if not ok:
        return []
    ok, specs = _attempt(report, "data", lambda: data_specs(cfg, task, data_dir=data_dir))
    if not ok:
        return []
    train_spec, eval_spec = specs
    if cfg.reward is not None:
        reward, reward_field = _reward(report, cfg.reward, "reward"), "reward"
    elif task is not None:
        reward, reward_field = task, "task"
    else:
        report.problem(
            "reward",
            "not set and no built-in task supplies one; set reward: {type: 'reward.py:score'} "
            "(a file next to the recipe) or {type: 'my_pkg.rewards:score'}.",
        )
        reward, reward_field = None, "reward"
    threshold = cfg.eval.correct_threshold
    out = [
        _EvalTarget(
            set_name="train",
            field="data.train",
            spec=train_spec,
            reward=reward,
            reward_field=reward_field,
            threshold=threshold,
        )
    ]
    if eval_spec is not None:
        out.append(
            _EvalTarget(
                set_name="eval",
                field="data.eval",
                spec=eval_spec,
                reward=reward,
                reward_field=reward_field,
                threshold=threshold,
            )
        )
    for i, ds in enumerate(cfg.eval.datasets):
        where = f"eval.datasets[{i}]"
        ds_reward, ds_field = reward, reward_field
        if ds.reward is not None:
            ds_reward, ds_field = _reward(report, ds.reward, f"{where}.reward"), f"{where}.reward"
        out.append(
            _EvalTarget(
                set_name=f"eval/{ds.name}",
                field=f"{where}.data",
                spec=ds.data,
                reward=ds_reward,
                reward_field=ds_field,
                threshold=ds.correct_threshold if ds.correct_threshold is not None else threshold,
            )
        )
    return out


def _sample(
    report: CheckReport,
    cfg: TrainerConfig,
    target: _EvalTarget,
    tokenizer: Any,
    rows: int,
    model_cfg: dict[str, Any] | None = None,
    model_path: str = "",
) -> None:
    """Read one data set, check that the train prompts fit the model's context with the
    response budget (:func:`rl_trainer.load_checks.check_context`), render ``rows`` prompts
    and score the test responses on them."""
    ok, source = _attempt(
        report,
        target.field,
        lambda: registry.build("data_source", target.spec, field=target.field, tokenizer=tokenizer),
    )
    if not ok:
        return
    if target.set_name == "train" and model_cfg and cfg.mode != "sft":
        from rl_trainer.load_checks import check_context

        budget = ("rollout.sampling.max_new_tokens", cfg.rollout.sampling.max_new_tokens)
        _attempt(
            report,
            target.field,
            lambda: check_context(
                model_cfg, model_path, [(target.field, source, None, budget[1], budget[0])]
            ),
        )
    prompts: list[Prompt] = source.next_prompts(min(rows, len(source)))
    if target.set_name == "train" and cfg.sft.steps > 0:
        unlabelled = [p.uid for p in prompts if p.label is None]
        if unlabelled:
            report.problem(
                target.field,
                f"rows without a label ({', '.join(unlabelled)}) but sft.steps is "
                f"{cfg.sft.steps}: the warm-up trains on the labels. Add a label to every row "
                "(label_key) or set sft.steps: 0.",
            )
    probed: list[Group] | None = None
    if target.set_name == "train" and cfg.rollout.generate_fn is not None and prompts:
        probed = _probe_generate_fn(report, cfg, tokenizer, prompts[0])
    if target.reward is not None and getattr(target.reward, "scores_sessions", False):
        _session_reward(report, cfg, target, tokenizer, prompts, probed)
        return
    recorder = _Recorder(target.reward) if target.reward is not None else None
    scorer = (
        Scorer(recorder, tokenizer, timeout_s=cfg.rollout.reward_timeout_s)
        if recorder is not None
        else None
    )
    failures: list[str] = []
    low_label: list[str] = []
    high_dummy: list[str] = []
    for p in prompts:

        def score(text: str, p: Prompt = p) -> float | None:
            if recorder is None or scorer is None:
                return None
            value, error = _score(recorder, scorer, p, text, tokenizer)
            if error is not None:
                failures.append(f"prompt {p.uid}: {error}")
            return value

        dummy = [score(t) for t in DUMMY_RESPONSES.values()]
        label = _label_text(p.label)
        label_reward = score(label) if label is not None else None
        if label_reward is not None and label_reward < target.threshold:
            low_label.append(f"{p.uid} ({label!r} -> {label_reward:g})")
        for text, value in zip(DUMMY_RESPONSES.values(), dummy):
            if value is not None and value >= target.threshold:
                high_dummy.append(f"{p.uid} ({text!r} -> {value:g})")
        report.rows.append(
            SampleRow(
                set_name=target.set_name,
                uid=p.uid,
                prompt_text=tokenizer.decode(list(p.token_ids), skip_special_tokens=False),
                num_tokens=len(p.token_ids),
                label=label,
                dummy_rewards=dummy,
                label_reward=label_reward,
            )
        )
    if failures:
        report.problem(
            f"{target.reward_field} on {target.set_name}",
            f"the reward failed on {len(failures)} test response(s); first: {failures[0]}",
        )
    if low_label:
        report.warning(
            f"{target.reward_field} on {target.set_name}",
            f"the label answer scores below the correct threshold {target.threshold:g} on "
            f"{len(low_label)} of {len(prompts)} rows ({', '.join(low_label[:3])}). Expected if "
            "the reward wants a format the bare label lacks; otherwise check that the reward "
            "compares the response with prompt.label.",
        )
    if high_dummy:
        report.warning(
            f"{target.reward_field} on {target.set_name}",
            f"a dummy response scores at or above the correct threshold {target.threshold:g} "
            f"({', '.join(high_dummy[:3])}); the reward may give credit for any answer.",
        )


def _session_reward(
    report: CheckReport,
    cfg: TrainerConfig,
    target: _EvalTarget,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    probed: list[Group] | None,
) -> None:
    """The reward probe of a reward that scores an agent's session
    (``SessionReward.scores_sessions``: ``reward: {type: session_reward}``), not a response
    text: the dummy and label responses are not scored (a note says so); on the train set the
    dry session that :func:`_probe_generate_fn` ran is scored instead, as the trainer would."""
    for p in prompts:
        report.rows.append(
            SampleRow(
                set_name=target.set_name,
                uid=p.uid,
                prompt_text=tokenizer.decode(list(p.token_ids), skip_special_tokens=False),
                num_tokens=len(p.token_ids),
                label=_label_text(p.label),
                dummy_rewards=[None] * len(DUMMY_RESPONSES),
                label_reward=None,
            )
        )
    where = f"{target.reward_field} on {target.set_name}"
    type_name = _type_name(cfg, target)
    env = type(target.reward).__name__ == "EnvReward" or "env_reward" in type_name
    scored_what = (
        "an environment's episode (env_reward: the sum of the rewards its steps returned)"
        if env
        else "an agent's session (the reward its program reported)"
    )
    skipped = (
        f"the reward ({type_name}) scores {scored_what}, not a response text, so the dummy "
        "and label responses are not scored (the '-' columns)"
    )
    if cfg.rollout.generate_fn is None:
        runner = (
            "an environment loop (type: env, with env: <your Environment class>)"
            if env
            else "an agent (type: agent, program or command)"
        )
        report.problem(
            where,
            f"{skipped}, and no rollout.generate_fn runs {'episodes' if env else 'sessions'}: "
            f"every rollout would fail. Set rollout.generate_fn to {runner} or use a reward "
            "that scores the response.",
        )
        return
    unit = "episode" if env else "session"
    if target.set_name != "train" or probed is None:
        report.note(where, f"{skipped}; the train set's dry {unit} is scored instead.")
        return
    rollouts = [r for g in probed for r in g.rollouts]
    stats = RolloutStats()
    scorer = Scorer(target.reward, tokenizer, timeout_s=cfg.rollout.reward_timeout_s)
    asyncio.run(scorer.score(probed, stats))
    scored = [r.reward for r in rollouts if r.reward is not None]
    if not scored:
        first = next(iter(stats.first.values()), None)
        why = first.error if first is not None else "no rollout came back"
        report.problem(
            where,
            f"{skipped}; the dry {unit}(s) on prompt {probed[0].prompt.uid} (every generation "
            f"answered with EOS) gave no reward: {why}",
        )
        return
    report.note(
        where,
        f"{skipped}; the dry {unit}(s) on prompt {probed[0].prompt.uid} (every generation "
        f"answered with EOS) scored {', '.join(f'{x:g}' for x in scored)} "
        f"({len(scored)} of {len(rollouts)} rollouts).",
    )


def _type_name(cfg: TrainerConfig, target: _EvalTarget) -> str:
    """How the config names the reward of ``target`` (``type: session_reward``)."""
    spec = cfg.reward if target.reward_field == "reward" else None
    return f"type {spec.type!r}" if spec is not None else target.reward_field


def check_recipe(
    recipe: str | Path, overrides: Sequence[str] = (), *, rows: int = 3
) -> CheckReport:
    """Check a recipe without building a model (see the module docstring): every problem and
    warning found, and ``rows`` rendered and scored prompts of every data set."""
    report = CheckReport(recipe=str(recipe))
    ok, cfg = _attempt(report, "recipe", lambda: load_trainer_config(recipe, list(overrides)))
    if not ok:
        return report
    # The settings the trainer will choose because the recipe leaves them open (and why).
    with contextlib.suppress(RLError):  # an unknown policy type: the component checks say it
        report.chosen = [c.line() for c in auto_choices(cfg)]
    if cfg.preset is not None:
        plain = to_dict(cfg)
        report.preset = str(cfg.preset)
        report.merged = {k: plain[k] for k in PRESET_SECTIONS if plain.get(k) is not None}
        report.replaced = shadowed_keys(load_preset(report.preset), plain)
    ok, tokenizer = _attempt(report, "model", lambda: load_tokenizer(cfg))
    model_path = cfg.model.path or str(cfg.run_path / "init_model")
    _check_components(report, cfg, model_path)
    if not ok:
        return report
    model_cfg = _model_limits(report, cfg, tokenizer, model_path)
    with tempfile.TemporaryDirectory(prefix="rl-check-") as tmp:  # a task's splits go here
        for target in _targets(report, cfg, Path(tmp)):
            _sample(report, cfg, target, tokenizer, rows, model_cfg, model_path)
    return report


def _model_limits(
    report: CheckReport, cfg: TrainerConfig, tokenizer: Any, model_path: str
) -> dict[str, Any] | None:
    """The model's config (``model.path``'s ``config.json``, or the one ``model.init`` would
    build; no weights), after the checks of what it cannot honour that need no data
    (:func:`rl_trainer.load_checks.check_routing`)."""
    from rl_trainer.load_checks import check_routing, read_model_config

    def config() -> dict[str, Any]:
        if cfg.model.path:
            return read_model_config(cfg.model.path)
        from rl_hf.tiny import TinyModelSpec, tiny_model_config

        spec = from_dict(
            TinyModelSpec, {"seed": cfg.seed, **(cfg.model.init or {})}, path="model.init"
        )
        return tiny_model_config(spec, tokenizer).to_dict()

    ok, model_cfg = _attempt(report, "model", config)
    if not ok:
        return None
    _attempt(
        report,
        "rollout.routing_replay",
        lambda: check_routing(cfg.rollout.routing_replay, model_cfg, model_path),
    )
    return model_cfg


class _ProbeGenerator:
    """The generator of :func:`_probe_generate_fn`: every request ends at once with the EOS
    token (no model is built by ``check``)."""

    supports_abort = False
    supports_pause = False

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.weight_version = 0
        self.calls = 0

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.calls += len(requests)
        return [
            GenerationResult(
                request_id=r.request_id,
                output_ids=(self.eos,),
                output_logprobs=(0.0,),
                finish_reason=FinishReason.STOP,
                weight_version=0,
            )
            for r in requests
        ]


PROBE_TIMEOUT_S = 60.0
"""How long ``check`` waits for the rollout function's dry call."""


def _probe_generate_fn(
    report: CheckReport, cfg: TrainerConfig, tokenizer: Any, p: Prompt
) -> list[Group] | None:
    """Call ``rollout.generate_fn`` once on ``p`` with a generator that answers EOS at once, as
    the trainer calls it: a function that raises, returns nothing or not a list of
    ``Rollout`` is a problem now rather than at the first round. Returns the groups it gave
    (for a session reward to score), or ``None`` when the call failed."""
    from rl_buffer.rollout import generate_groups

    ok, fn = _attempt(
        report,
        "rollout.generate_fn",
        lambda: build_callable(
            "generate_fn", cfg.rollout.generate_fn, GenerateFn, field="rollout.generate_fn"
        ),
    )
    if not ok:
        return None
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0

    async def call() -> Any:
        try:
            return await _call(fn)
        finally:
            close = getattr(fn, "aclose", None)  # an agent's server
            if close is not None:
                await close()

    async def _call(fn: Any) -> Any:
        return await asyncio.wait_for(
            generate_groups(
                [p],
                generator=_ProbeGenerator(int(eos)),  # type: ignore[arg-type]
                tokenizer=tokenizer,
                sampling=cfg.rollout.sampling.to_params(),
                n_samples=cfg.rollout.n_samples,
                seed_parts=(cfg.seed, "check"),
                policy_version=0,
                generate_fn=fn,
                generate_fn_name=f"rollout.generate_fn (type {cfg.rollout.generate_fn.type!r})",
            ),
            PROBE_TIMEOUT_S,
        )

    try:
        return asyncio.run(call())
    except TimeoutError:
        report.warning(
            "rollout.generate_fn",
            f"a dry call on prompt {p.uid} (every generation answered with EOS) did not return "
            f"within {PROBE_TIMEOUT_S:g} s; check that it does not wait on something a real "
            "run would not give it.",
        )
    except RLError as e:
        report.problem(
            "rollout.generate_fn",
            f"a dry call on prompt {p.uid} (every generation answered with EOS) failed: {e}",
        )
    return None


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "nan" if math.isnan(value) else f"{value:.3g}"


def print_report(report: CheckReport, console: Any = None) -> None:
    """Print the sample table, then every finding, then a one-line verdict."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if console is None:
        console = Console(highlight=False, soft_wrap=False)
        if not console.is_terminal:
            console.width = max(console.width, 120)
    if report.rows:
        legend = ", ".join(f"{k} = {v!r}" for k, v in DUMMY_RESPONSES.items())
        table = Table(
            title=f"rl-train check {report.recipe}",
            caption=f"reward columns: the set's reward on {legend}, and on the label",
            show_lines=True,
        )
        table.add_column("set", no_wrap=True)
        table.add_column("uid", no_wrap=True)
        table.add_column("prompt as the model sees it (↵ = newline)")
        table.add_column("tokens", justify="right")
        table.add_column("label")
        for name in DUMMY_RESPONSES:
            table.add_column(f"reward {name}", justify="right")
        table.add_column("reward label", justify="right")
        for r in report.rows:
            table.add_row(
                r.set_name,
                r.uid,
                Text(r.prompt_text.replace("\n", "↵\n").removesuffix("\n")),
                str(r.num_tokens),
                Text("-" if r.label is None else repr(r.label)),
                *(_fmt(v) for v in r.dummy_rewards),
                _fmt(r.label_reward),
            )
        console.print(table)
    if report.preset is not None:
        import yaml

        console.print(
            Text(
                f"merged config under preset {report.preset!r} (the recipe's values win):",
                style="bold",
            )
        )
        console.print(Text(yaml.safe_dump(report.merged, sort_keys=False).rstrip()))
        if report.replaced:
            console.print(
                Text(
                    f"preset {report.preset!r} values replaced by the recipe or --set: "
                    + ", ".join(report.replaced)
                )
            )
    for chosen in report.chosen:
        console.print(Text(f"chosen for this run: {chosen}", style="cyan"))
    for f in report.findings:
        style = {"problem": "bold red", "warning": "yellow"}.get(f.level, "cyan")
        line = Text(f"{f.level.upper()} ", style=style)
        line.append(f"{f.where}: ", style="bold")
        line.append(f.message)
        console.print(line)
    n_p, n_w = len(report.problems), len(report.warnings)
    if n_p:
        console.print(Text(f"check failed: {n_p} problem(s), {n_w} warning(s).", style="bold red"))
    else:
        scored = sum(
            r.label_reward is not None or any(v is not None for v in r.dummy_rewards)
            for r in report.rows
        )
        what = (
            f"{len(report.rows)} prompts rendered and scored"
            if scored == len(report.rows)
            else f"{len(report.rows)} prompts rendered, {scored} scored (see the notes)"
        )
        console.print(Text(f"check passed: {what}, {n_w} warning(s).", style="bold green"))
