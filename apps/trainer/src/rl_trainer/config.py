"""The trainer's root configuration: one typed tree built from a recipe plus ``--set`` overrides.

A recipe is YAML or TOML::

    run_dir: runs/demo
    seed: 1
    model: {init: {arch: qwen2, hidden_size: 128, num_layers: 2}}
    task: {type: reverse, n_train: 4000}
    rollout: {prompts_per_step: 16, n_samples: 8, sampling: {temperature: 1.0, max_new_tokens: 12}}
    rl: {steps: 150}

Components are chosen by registry name (``policy: {type: hf, lr: 1e-4}``); their options are
validated by the component's own ``Config`` when the trainer builds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from rl_core import registry
from rl_core.config import (
    CodeRef,
    ComponentSpec,
    InputPath,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Range,
    apply_overrides,
    from_dict,
    load_config_file,
)
from rl_core.errors import ConfigError
from rl_core.locations import absolute_path
from rl_core.logprobs import truncates
from rl_core.rewards.shaping import OverlongPenalty
from rl_core.types import SamplingParams
from rl_trainer.presets import preset_override, resolve_recipe_data

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "EvalDatasetConfig",
    "EvalSamplingConfig",
    "LoggingConfig",
    "ModelConfig",
    "RLConfig",
    "RoleResources",
    "RolloutConfig",
    "RuntimeConfig",
    "SFTConfig",
    "SamplingConfig",
    "TeacherConfig",
    "TrainerConfig",
    "WandbConfig",
    "load_trainer_config",
]


_HUB_HINT = (
    "model.path is a local directory; for a Hugging Face Hub model, download it first "
    "(huggingface-cli download ORG/NAME --local-dir DIR) and set model.path to DIR."
)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Where the initial weights and tokenizer come from."""

    path: Annotated[str, InputPath(hint=_HUB_HINT)] | None = None
    """A Hugging Face model directory (relative: to the recipe's directory). When ``init`` is
    set and this is empty, the tiny model is built into ``<run_dir>/init_model``."""
    init: dict[str, Any] | None = None
    """Build a tiny random model from this spec (fields of
    :class:`rl_hf.tiny.TinyModelSpec`) instead of loading one; no downloads."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompt sources, when not given by a built-in ``task``."""

    train: ComponentSpec | None = None
    """Training prompts, e.g. ``{type: jsonl, path: data/train.jsonl}``."""
    eval: ComponentSpec | None = None
    """Held-out prompts for evaluation."""


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """Sampling settings (see :class:`rl_core.types.SamplingParams`)."""

    temperature: NonNegFloat = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Nucleus mass."""
    top_k: NonNegInt = 0
    """Top-k cut; 0 disables it."""
    max_new_tokens: PositiveInt = 32
    """Response length limit."""
    stop_token_ids: list[NonNegInt] = field(default_factory=list)
    """Extra stop tokens besides the tokenizer's EOS."""

    def to_params(self, *, seed: int | None = None) -> SamplingParams:
        """The :class:`SamplingParams` for one request."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            seed=seed,
        )


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """How groups are generated and kept."""

    prompts_per_step: PositiveInt = 16
    """Groups (prompts) trained on per RL step."""
    n_samples: PositiveInt = 8
    """Rollouts per prompt (GRPO group size)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling for training rollouts."""
    generate_fn: ComponentSpec | None = None
    """A custom rollout (``GenerateFn``); default: plain single-turn sampling."""
    filters: list[ComponentSpec] = field(default_factory=list)
    """Group filters (dynamic sampling); dropped groups are replaced by over-sampling."""
    over_sampling_factor: Annotated[float, Range(ge=1)] = 1.0
    """With filters: ask for this many times the prompts the observed keep rate suggests."""
    surplus_groups: Literal["carry", "discard"] = "carry"
    """Kept groups beyond ``prompts_per_step`` once a step's batch is full (over-sampling
    overshoots): ``carry`` them over to the next step (within ``rl.max_staleness``), or
    ``discard`` them as the DAPO paper and verl's DAPO recipe do (the ``dapo`` preset);
    counted in ``rollout/dynamic_filter/surplus_discarded``."""
    overlong_penalty: OverlongPenalty.Config | None = None
    """DAPO's soft overlong punishment added to every training rollout's reward before the
    filters see it (``{band: 4, max_length: 12, coef: 1.0}``; ``max_length`` defaults to
    ``sampling.max_new_tokens``): 0 up to ``max_length - band`` response tokens, then linearly
    down to ``-coef`` at ``max_length`` (:mod:`rl_core.rewards.shaping`); logged as
    ``rollout/overlong_penalty_mean``. ``None``: off. Eval rewards are never shaped."""
    reward_timeout_s: PositiveFloat | None = 300.0
    """Time limit of one reward call (and of one group-reward call). A call still running
    then is abandoned (a synchronous reward runs in a worker thread that is left behind) and
    its rollouts fail with ``reward_timeout``; the step goes on. ``None``: no limit."""
    reward_round_timeout_s: PositiveFloat | None = 1800.0
    """Time limit of scoring one round (every reward call of a generation round, eval
    included); the calls still running then fail with ``reward_timeout``. ``None``: no
    limit."""
    max_rounds: PositiveInt = 8
    """Generation rounds per step at most when filters drop groups (then the run stops with an
    error naming the filters)."""
    dump_dir: str | None = None
    """Write every RL step's trained groups (tokens, masks, log-probs, versions, rewards and
    components, advantages, routing) here (:mod:`rl_trainer.ops.dumps`), for ``rl-train show``,
    ``rl-train replay`` and offline analysis; ``None``: no dumps."""
    routing_replay: Literal["off", "record", "replay"] = "off"
    """Mixture-of-experts routing replay (R3). ``record``: the generator returns the experts it
    chose for every token (``rollout.routed_experts``, kept in the buffer and checkpoints) and
    the step reports how the trainer's routing differs (``routing/*`` metrics), but the policy
    routes on its own. ``replay``: also make the policy's MoE layers use exactly the engine's
    experts in every log-prob pass and the training step. Needs a generator with
    ``supports_routing`` and, for ``replay``, a policy with ``supports_routing_replay``
    (checked at start-up), and a mixture-of-experts model."""
    adapter_key: str | None = None
    """Multi-LoRA (``policy.lora.adapters``): the ``Prompt.metadata`` field whose value names
    the adapter that samples and trains on a prompt (e.g. ``task``, filled by the data
    source's ``metadata_key``); a prompt without it uses the default adapter. Required with
    ``policy.lora.adapters``, refused without (docs/lora.md)."""
    routing_no_replay_every: NonNegInt = 1
    """With ``routing_replay: replay``: on step 1 and every this many steps after it, run one
    more log-prob pass without replay, for ``routing/mismatch_no_replay`` and
    ``routing/logprob_mismatch_no_replay`` (what replay removed); 0 never."""


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Advantage estimator and loss."""

    advantage: Annotated[str, CodeRef()] = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, or
    ``module:attr``."""
    advantage_options: dict[str, Any] = field(default_factory=dict)
    """Options of the estimator's ``Config``."""
    loss: dict[str, Any] = field(default_factory=dict)
    """Options of :class:`rl_core.algorithms.losses.PolicyLoss`'s ``Config`` (variant, clip
    ranges, entropy and KL coefficients, mismatch correction)."""
    aggregation: Literal["token", "sequence", "rollout", "constant"] = "token"
    """How token losses are averaged over the step."""
    aggregation_constant: PositiveFloat | None = None
    """Divisor per sequence for ``aggregation: constant`` (Dr.GRPO: the max response length);
    ``None`` with ``constant``: ``rollout.sampling.max_new_tokens``."""
    use_reference: bool = False
    """Keep a frozen copy of the initial policy for a KL loss (needs ``loss.kl_coef`` > 0)."""
    recompute_old_logprobs: bool = False
    """Run a separate forward for old log-probs even when the data is on-policy (one optimizer
    step per rollout batch makes them equal to the current ones, so the default skips it).
    Several updates per batch (``rl.ppo_epochs``, ``rl.mini_batches_per_step``) always compute
    them."""
    value_loss: dict[str, Any] = field(default_factory=dict)
    """Options of the critic's :class:`rl_core.algorithms.ValueLoss` (``clip``); used with
    ``critic``."""


_TEACHER_HINT = (
    "teacher.path is a local model directory with the student's tokenizer; a teacher trained "
    "on the demo task is written by `rl-train run demo` (runs/demo/final_model)."
)


@dataclass(kw_only=True, slots=True)
class TeacherConfig:
    """On-policy distillation (OPD): a frozen teacher scores the tokens the student sampled, and
    the per-token reverse KL ``logp_student - logp_teacher`` is subtracted from the advantage
    (``A_t = reward_weight * A_task_t - coef * (logp_student_t - logp_teacher_t)``, as slime
    and Tinker do). The teacher must share the student's tokenizer. See
    :mod:`rl_trainer.step.teacher`."""

    type: str = "hf"
    """Teacher backend: a policy backend by registry name (``hf``: the transformers reference
    backend; ``megatron``), built frozen from ``path`` (log-probs only, no optimizer steps); or
    ``sglang``: an SGLang server at ``url`` scoring given tokens through its log-prob API."""
    path: Annotated[str, InputPath(hint=_TEACHER_HINT)] | None = None
    """The teacher's model directory (``hf``, ``megatron``; with ``sglang`` optional: its
    tokenizer is checked against the student's when given)."""
    url: str | None = None
    """``sglang``: the server (or router) URL, e.g. ``http://127.0.0.1:30000``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Backend options: the policy backend's ``Config`` fields (``dtype``, ``device``, ...) or
    :class:`rl_sglang.teacher.SGLangTeacher`'s (``timeout_s``, ``max_retries``, ...)."""
    coef: NonNegFloat = 1.0
    """Weight of the reverse-KL term in the advantage."""
    reward_weight: NonNegFloat = 0.0
    """Weight of the task advantage (from the reward) in the advantage; 0 is pure
    distillation, > 0 mixes the teacher's signal with the task reward."""
    student_logprobs: Literal["policy", "rollout"] = "policy"
    """The student log-probs of the reverse KL: ``policy`` recomputes them with the trained
    policy (exact, one more forward; they also serve as the old log-probs); ``rollout`` uses
    the engine's sampling log-probs (no forward; off by the engine/trainer mismatch)."""

    def __post_init__(self) -> None:
        if self.type == "sglang":
            if not self.url:
                raise ConfigError(
                    "teacher.url: a teacher of type 'sglang' needs the server URL "
                    "(e.g. http://127.0.0.1:30000)."
                )
        elif self.path is None:
            raise ConfigError(
                f"teacher.path: a teacher of type {self.type!r} needs its model directory; "
                "set teacher.path (e.g. --set teacher.path=runs/opd_teacher/final_model)."
            )
        if self.coef == 0 and self.reward_weight == 0:
            raise ConfigError(
                "teacher.coef and teacher.reward_weight are both 0: the advantage would be 0; "
                "set teacher.coef > 0 (distillation) and/or teacher.reward_weight > 0."
            )


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    """Optional supervised warm-up on the training labels before RL."""

    steps: NonNegInt = 0
    """Optimizer steps of warm-up; 0 skips it."""
    batch_size: PositiveInt = 64
    """Examples per step."""
    lr: NonNegFloat | None = None
    """Learning rate of the warm-up (default: the policy's). RL starts from the warm-up's
    weights with a fresh optimizer at the policy's learning rate."""
    lora: bool = True
    """With ``policy.lora``: train the warm-up's adapter (true) or every weight (false, e.g.
    on a randomly initialised ``model.init`` that adapters alone cannot teach the format).
    Either way RL starts a fresh adapter on the warm-up's (merged) weights."""


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """The RL phase."""

    steps: NonNegInt = 100
    """RL steps (one rollout batch each, ``ppo_epochs * mini_batches_per_step`` optimizer
    steps); 0 runs only the ``sft`` warm-up (a run needs at least one step of either)."""
    ppo_epochs: PositiveInt = 1
    """Passes over each rollout batch (PPO epochs). Above 1 (or with several mini-batches) the
    old log-probs are computed once before the first update and the importance ratio and
    clipping act in the later ones (``train/pg_clipfrac`` is their mean)."""
    mini_batches_per_step: PositiveInt = 1
    """Mini-batches each rollout batch is split into, by whole groups (prompts), each one
    optimizer step of the policy (and the critic) per epoch; the loss aggregation is computed
    per mini-batch. The policy version advances ``ppo_epochs * mini_batches_per_step`` per RL
    step; ``max_staleness`` and ``mask_older_than`` count RL steps. Needs
    ``rollout.prompts_per_step`` to be a multiple of it."""
    max_tokens_per_micro_batch: PositiveInt = 4096
    """Token cap of one micro-batch."""
    skip_zero_advantage: bool = True
    """Leave samples whose advantage is 0 on every trained token (a group whose rewards are all
    equal, under GRPO-style estimators) out of the step's forward and backward passes, with the
    loss weights computed over the whole step first, so the update is the same up to the order
    of floating-point sums (:mod:`rl_core.algorithms.skipping`). Off by itself where such
    samples still give gradient: an entropy bonus or KL loss, a critic, several updates per
    step, a teacher. When no sample gives gradient one (the shortest) is kept so the optimizer
    still steps. ``train/skipped_samples_frac`` reports the share left out; the per-token
    metrics (entropy, KL, clip fractions) are then means over the trained tokens."""
    async_generation: bool = False
    """Overlap generation and training: while the policy trains step k (in a trainer thread),
    the generator produces the groups of the next steps. With ``async_mode: lockstep`` (the
    default) it uses the weights exactly ``max_staleness`` versions behind, and weights reach
    the generator between generation rounds only (no request is cut short), so runs stay
    reproducible and resume exactly; ``async_mode: continuous`` keeps generating on the newest
    weights instead. Off: generate, then train, step by step."""
    async_mode: Literal["lockstep", "continuous"] = "lockstep"
    """How ``async_generation`` schedules generation. ``lockstep``: the round of step k is
    generated with exactly the version ``max_staleness`` RL steps behind the policy that trains
    it (a pure function of the seed: reproducible, exact resume; 0 is the synchronous run).
    ``continuous``: a producer keeps generating rounds back to back while the trainer trains,
    each on the newest released weights (with ``partial_rollouts`` also mid-round), at most
    ``max_staleness`` rounds ahead of the trainer; the bound is enforced per token when a step
    takes its groups: a group holding a token older than ``max_staleness`` RL steps is dropped
    (``rollout/stale_dropped_at_take``) and the step waits for fresher rounds. Fresher data, but not
    bit-reproducible. Needs ``async_generation`` and ``max_staleness >= 1``."""
    max_staleness: NonNegInt = 1
    """How many policy versions older than the policy being trained a rollout token may be,
    counted in RL steps (``ppo_epochs * mini_batches_per_step`` versions each when a step
    takes several optimizer steps); older groups are never trained on (dropped before they
    reach the buffer, counted in ``rollout/stale_dropped``). With ``async_generation`` it is also how far generation runs
    ahead; 0 reproduces the synchronous run exactly. In the synchronous loop only surplus
    groups carried over by dynamic sampling can be stale (by one version)."""
    mask_older_than: NonNegInt | None = None
    """Zero the loss on response tokens more than this many versions (RL steps, as for
    ``max_staleness``) older than the policy being trained (they still count in their group's advantage baseline); ``None`` trains on
    every token within ``max_staleness``. Off-policy tokens can instead be reweighted with
    ``algorithm.loss.correction: tis``."""
    partial_rollouts: bool = False
    """With ``async_generation`` and ``max_staleness >= 1``: when the trainer releases new
    weights while a round is generating, abort its in-flight requests, keep their partial
    tokens (with per-token versions) in the buffer, load the new weights and resume them, so
    rounds train on fresher tokens. A rollout's tokens may then span versions (all within
    ``max_staleness``); mask the older part with ``buffer.mask_offpolicy_tokens: true`` or
    ``rl.mask_older_than``, or reweight it with ``algorithm.loss.correction: tis``. A custom
    ``rollout.generate_fn`` (multi-turn, agents) gets a resumable ``ctx.generator``
    (:class:`rl_agents.resumable.ResumableGenerator`): finished turns keep their tokens and
    versions, the in-flight turn is aborted and resumed on the new weights, the episode goes on.
    Needs a generator that supports abort. Where an abort lands depends on timing, so runs are
    not bit-reproducible."""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """What a LoRA policy (``policy.lora``) publishes to the generator: ``adapter`` only the
    adapter tensors (peft names, a few MB; the generator loads them as a named adapter on its
    base), ``merged`` the merged full weights, ``auto`` the adapter when the generator takes
    adapters (``hf`` does) and the runtime is local, else merged. Ignored without LoRA."""

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps (policy versions) per RL step: ``ppo_epochs * mini_batches_per_step``."""
        return self.ppo_epochs * self.mini_batches_per_step


@dataclass(kw_only=True, slots=True)
class EvalSamplingConfig:
    """Eval sampling: every field left unset follows training (``rollout.sampling``), except
    ``temperature``, which is greedy (0) unless set. In an ``eval.datasets[]`` entry, unset
    fields follow ``eval.sampling`` first."""

    temperature: float | None = None
    """Softmax temperature; default 0 (greedy: each prompt's most likely answer). Set it above
    0 to evaluate the sampled policy, as ``n_samples`` > 1 and pass@k with k > 1 need."""
    top_p: float | None = None
    """Nucleus mass; default ``rollout.sampling.top_p``."""
    top_k: int | None = None
    """Top-k cut (0 disables it); default ``rollout.sampling.top_k``."""
    max_new_tokens: int | None = None
    """Response length limit; default ``rollout.sampling.max_new_tokens``, so eval answers are
    cut where training answers are."""
    stop_token_ids: list[int] | None = None
    """Extra stop tokens besides the tokenizer's EOS; default
    ``rollout.sampling.stop_token_ids``."""

    def resolve(self, train: SamplingConfig, *fallbacks: EvalSamplingConfig) -> SamplingConfig:
        """The sampling this sets: each field from ``self``, else the first of ``fallbacks``
        that sets it, else greedy for ``temperature`` and ``train``'s value for the rest."""
        layers = (self, *fallbacks)

        def pick(name: str, default: Any) -> Any:
            return next((v for v in (getattr(x, name) for x in layers) if v is not None), default)

        return SamplingConfig(
            temperature=pick("temperature", 0.0),
            top_p=pick("top_p", train.top_p),
            top_k=pick("top_k", train.top_k),
            max_new_tokens=pick("max_new_tokens", train.max_new_tokens),
            stop_token_ids=list(pick("stop_token_ids", train.stop_token_ids)),
        )


@dataclass(kw_only=True, slots=True)
class EvalDatasetConfig:
    """One extra evaluation dataset with its own reward, sampling and schedule."""

    name: str
    """Metric prefix: results are logged as ``eval/<name>/reward_mean``, ``eval/<name>/pass@k``."""
    data: ComponentSpec
    """Prompt source (``{type: jsonl, path: ...}``, any registered data source)."""
    reward: ComponentSpec | None = None
    """Reward function for this dataset; default: the run's reward."""
    max_prompts: int | None = None
    """Evaluate on at most this many prompts."""
    n_samples: int | None = None
    """Samples per prompt; default ``eval.n_samples``."""
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    """Sampling for this dataset; each unset field follows ``eval.sampling``, then
    ``rollout.sampling`` (temperature: greedy)."""
    pass_k: list[int] | None = None
    """pass@k values to report; default ``eval.pass_k``. Each k must be <= n_samples."""
    correct_threshold: float | None = None
    """A sample is correct when its reward is >= this; default ``eval.correct_threshold``."""
    every: int | None = None
    """Evaluate every N RL steps (and at RL step 0 and the last step); default ``eval.every``;
    0 disables this set."""


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Evaluation on the held-out prompts (the task's eval split or ``data.eval``) and on any
    extra ``datasets``."""

    every: int = 10
    """Evaluate every N RL steps (and at RL step 0 and the last step); 0 disables."""
    max_prompts: int | None = None
    """Evaluate on at most this many held-out prompts."""
    n_samples: int = 1
    """Samples per eval prompt; above 1 needs ``sampling.temperature`` > 0 (greedy samples
    are all the same answer)."""
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    """Eval sampling: greedy by default, with the response length and stop tokens of
    ``rollout.sampling`` unless set here."""
    pass_k: list[int] = field(default_factory=list)
    """pass@k values to report (unbiased estimator over ``n_samples`` per prompt), e.g. [1, 8]."""
    correct_threshold: float = 1.0
    """A sample counts as correct for pass@k and ``accuracy`` when its reward is >= this."""
    datasets: list[EvalDatasetConfig] = field(default_factory=list)
    """Extra evaluation datasets, each with its own reward, sampling, n_samples and schedule."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When checkpoints are written."""

    every: NonNegInt = 0
    """Save every N steps (SFT and RL steps count alike); 0 saves only at the end."""
    keep: PositiveInt = 2
    """Keep the newest K checkpoints."""
    on_damaged: Literal["fallback", "refuse"] = "fallback"
    """What ``--resume`` does when the newest checkpoint fails its checksums (a file truncated,
    flipped, missing, or not in its manifest): ``fallback`` warns naming each damaged file,
    renames the checkpoint to ``damaged-step_N`` and resumes from the newest intact one;
    ``refuse`` stops with a ``CheckpointError`` naming the damaged files. Damaged state is never
    loaded."""


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    """Weights & Biases sink (needs ``pip install 'rlpost-trainer[wandb]'``)."""

    project: str = "rl-train"
    """The W&B project."""
    entity: str | None = None
    """The W&B team or user; ``None``: your default entity."""
    name: str | None = None
    """The run's display name; ``None``: the last part of ``run_dir``."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """``offline`` writes the run under ``dir`` only (``wandb sync`` uploads it later)."""
    dir: str | None = None
    """Where W&B writes its files; ``None``: ``<run_dir>``."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Metrics outputs."""

    tensorboard: bool = True
    """Also write TensorBoard event files under ``<run_dir>/tb``."""
    progress: bool = True
    """Show a progress bar."""
    samples_every: NonNegInt = 0
    """Every N RL steps, write a few groups' decoded prompts, responses, rewards, advantages and
    per-token log-prob mismatch to ``<run_dir>/samples.jsonl`` (and TensorBoard text, a W&B
    table); ``rl-train show RUN --step N`` prints them. 0: never."""
    samples_groups: PositiveInt = 2
    """Groups per sample trace."""
    wandb: WandbConfig | None = None
    """Also log to Weights & Biases (config, step metrics, sample tables, the report);
    ``None``: off."""


@dataclass(kw_only=True, slots=True)
class RoleResources:
    """Processes of one role on the ``ray`` runtime and what each reserves."""

    count: NonNegInt = 1
    """Processes (Ray actors): SPMD ranks of the policy, or generator engines. A generator
    count of 0 builds the generator in the driver instead: a client of servers managed outside
    Ray (e.g. ``generator: {type: sglang, url: http://router:30000}``) with a file weight
    transport on a shared filesystem."""
    cpus: NonNegFloat = 1.0
    """CPUs reserved per process (its placement-group bundle share)."""
    gpus: NonNegFloat = 0.0
    """GPUs reserved per process."""


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """Where the components run: ``local`` (one process) or ``ray`` (actors in placement
    groups; see docs/ray.md). A recipe may write just ``runtime: ray``."""

    type: Literal["local", "ray"] = "local"
    """``local``: everything in this process (the embedded default). ``ray``: policy ranks and
    generators are Ray actors; the loop, buffer and rewards stay in this driver process."""
    address: str | None = None
    """Ray cluster to join (``auto``, ``ray://host:10001``, ``host:6379``); ``None`` starts a
    local cluster (or uses the one this process already started)."""
    num_cpus: PositiveInt | None = None
    """Logical CPUs of a locally started cluster (default: enough for every bundle)."""
    layout: Literal["colocated", "disaggregated"] = "disaggregated"
    """``disaggregated``: policy ranks and generators get separate bundles. ``colocated``:
    generator ``i`` shares the bundle of policy rank ``i`` (``generator.count`` <=
    ``policy.count``); in the synchronous loop the generator releases its memory while the
    policy trains, when the backend supports it."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy of the bundles."""
    policy: RoleResources = field(default_factory=RoleResources)
    """Policy ranks: one torch.distributed (gloo/NCCL) world; the reference model lives in
    the same processes."""
    generator: RoleResources = field(default_factory=RoleResources)
    """Generator engines; each round's requests are split across them."""
    release_generator_memory: bool = True
    """Colocated layout, synchronous loop: release generator memory around training (skipped
    when the generator backend has no ``supports_memory_release``)."""
    offload_policy: bool = False
    """Colocated layout, synchronous loop: keep the policy (critic, reference) offloaded while
    the generator runs; each step runs generate -> release generator memory -> onload -> train
    -> publish -> offload -> resume generator memory -> load weights and records
    ``memory/<phase>_bytes`` (see :mod:`rl_trainer.step.offload`). What moves is the policy's
    ``offload`` setting. On the ``local`` runtime ``layout: colocated`` is the one process."""
    generate_timeout_s: PositiveFloat = 300.0
    """A generator call running longer than this counts as hung: the engine is killed, its
    requests retried on the others, and it is restarted and re-synced."""
    max_generator_restarts: NonNegInt = 3
    """Engine restarts allowed per run before the run stops with an error."""
    policy_timeout_s: PositiveFloat | None = None
    """Stop the run (with an error naming the rank) when one policy call takes longer;
    ``None`` waits as long as it takes."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of every actor."""
    trim_host_memory: bool = True
    """After RL steps, once training and the weight sync are done, return the memory the C
    allocator holds freed to the system (glibc ``malloc_trim(0)``, :mod:`rl_core.memory`; a
    no-op elsewhere): the step's temporaries of any policy backend and of an in-process
    generator, which glibc otherwise keeps (1.4-1.8 GB on SmolLM2-135M, issue #36). It trims
    after the first step, then whenever the resident memory grew by 256 MiB or more since the
    last trim (:class:`rl_core.memory.HostMemoryTrim`): a tiny model's few MB stay for the next
    step instead of being faulted in again. Values are unchanged.
    This process only: on the ``ray`` runtime the ``hf`` policy ranks trim after each train
    step themselves (``policy.trim_host_memory``)."""
    freeze_gc: bool | None = None
    """Once the phase that runs the run's steps (the RL phase; the SFT phase with ``mode:
    sft``) has built its models, move every object this process holds to the garbage
    collector's permanent generation (``gc.freeze``, after one collection), and back when the
    run ends (:class:`rl_core.memory.FrozenObjects`; a generator process does the same once
    built). Python's full collections otherwise walk the ~370k objects of torch, transformers
    and the models, holding the GIL (~0.1-0.3 s each) while the trainer and generator threads
    wait. ``None`` (auto): on for phases of at least
    ``rl_trainer.defaults.FREEZE_GC_MIN_STEPS`` (50) steps, where it pays for its collection.
    Values are unchanged either way."""
    generator_process: bool | None = None
    """``local`` runtime: run the generator (a backend taking weights through
    ``load_weights``: ``hf``) in a spawned process of its own instead of in this one, so its
    Python and the trainer's do not take turns on one GIL (with ``rl.async_generation``);
    requests go over a pipe and weights through shared memory
    (:mod:`rl_trainer.generator_process`). Start-up pays the child's imports and model load.
    ``None`` (auto): on for asynchronous runs with the ``hf`` generator, the ``inprocess``
    weight transport, the built-in rollout, no LoRA and ``threads >= 2`` of at least
    ``rl_trainer.defaults.GENERATOR_PROCESS_MIN_STEPS`` (358) RL steps, where the measured gain
    repays the start-up (:mod:`rl_trainer.defaults`; ``rl-train check`` says what it chose)."""


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The root configuration of one run."""

    mode: Literal["rl", "sft"] = "rl"
    """``rl``: the optional ``sft`` warm-up, then RL. ``sft``: supervised fine-tuning only, on
    chat conversations (``data.train`` with a messages ``input_key``), loss on assistant turns,
    ``sft.steps`` steps, ``eval/loss`` on ``data.eval``; ``rollout``/``rl``/``reward`` unused
    (``rl.max_tokens_per_micro_batch`` still caps micro-batches)."""
    run_dir: str = "runs/default"
    """Where metrics, checkpoints and the final model go."""
    preset: str | None = None
    """An algorithm preset (``rl_trainer/presets/<name>.yaml``: ``grpo``, ``dapo``, ...) applied
    under this recipe: its ``algorithm``/``rollout``/``rl`` values fill what the recipe leaves
    out, the recipe's own values win, ``--set`` wins over both (:mod:`rl_trainer.presets`;
    ``rl-train check`` shows the merged result). A recipe may also ``extends:`` another recipe
    (a bundled name or a path), which sits below the preset."""
    seed: Annotated[int, Range(ge=0, lt=2**32)] = 0
    """Seed of every random choice (data order, sampling, initialisation)."""
    threads: PositiveInt = 1
    """torch intra-op threads of the trainer process. With ``rl.async_generation`` on the
    local runtime the generator (``hf``) generates with half of them unless the recipe sets
    ``generator.threads``, and with ``runtime.generator_process`` the trainer keeps the other
    half (``rl_trainer.defaults.thread_split``)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Where the components run: ``local`` (one process, the default) or ``ray``."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Initial weights and tokenizer."""
    task: ComponentSpec | None = None
    """A built-in task that writes its train/eval data and supplies the reward
    (``{type: reverse}``); or set ``data`` and ``reward``."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt sources when no task is set (or to override the task's)."""
    reward: ComponentSpec | None = None
    """Reward function (``RewardFn``) by registry name, ``module:attr`` or ``file.py:attr``;
    default: the task's."""
    group_reward: ComponentSpec | None = None
    """A group reward (``GroupRewardFn``) scoring each prompt's rollouts together, e.g.
    ``{type: majority_vote, answer_pattern: ...}``. When set it is what is trained on; the
    per-rollout reward's components stay as ``rollout_<key>`` metrics (docs/agents.md)."""
    policy: ComponentSpec = field(default_factory=lambda: ComponentSpec(type="hf"))
    """The trained model backend."""
    generator: ComponentSpec = field(default_factory=lambda: ComponentSpec(type="hf"))
    """The rollout engine backend."""
    weight_transport: ComponentSpec = field(default_factory=lambda: ComponentSpec(type="inprocess"))
    """How weights reach the generator."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: a frozen teacher whose per-token reverse KL to the student is
    the advantage (alone or mixed with the task reward); ``None``: off."""
    critic: ComponentSpec | None = None
    """A value model for PPO with a critic (``{type: hf, lr: 1e-4}``), built from the RL start
    weights with a fresh value head; needs ``algorithm.advantage: gae``."""
    buffer: ComponentSpec = field(default_factory=lambda: ComponentSpec(type="group"))
    """Where scored groups wait for training."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm-up."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and loss."""
    rl: RLConfig = field(default_factory=RLConfig)
    """RL phase length and batching."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics outputs."""

    @property
    def run_path(self) -> Path:
        """``run_dir`` as a path."""
        return Path(self.run_dir)


def load_trainer_config(
    recipe: str | Path | dict[str, Any] | None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainerConfig:
    """Build the root config from a recipe file (or dict) plus ``a.b=c`` overrides.

    Every field is checked here, before anything heavy runs: names, types, numeric ranges, that
    ``model.path``, the data files and the code files named exist, and the options of the light
    components (data sources, task, rewards, filters, buffer, generate_fn). Relative paths in a
    recipe file resolve against its directory, those in ``--set`` against the current one.
    """
    if recipe is None:
        data: dict[str, Any] = {}
    elif isinstance(recipe, dict):
        data = recipe
    else:
        data = load_config_file(recipe)
    where = None if recipe is None or isinstance(recipe, dict) else Path(recipe).absolute().parent
    data = resolve_recipe_data(data, where=where, preset=preset_override(overrides))
    data = apply_overrides(data, list(overrides), base_dir=Path.cwd())
    if isinstance(data.get("runtime"), str):  # `runtime: ray` is short for `runtime: {type: ray}`
        data = {**data, "runtime": {"type": data["runtime"]}}
    cfg = from_dict(TrainerConfig, data)
    if cfg.task is None and cfg.data.train is None:
        raise ConfigError("task: set a built-in task (e.g. {type: reverse}) or data.train.")
    if cfg.model.path is None and cfg.model.init is None:
        raise ConfigError("model: set model.path (a Hugging Face directory) or model.init.")
    if cfg.mode == "sft" and (cfg.sft.steps == 0 or cfg.data.train is None):
        raise ConfigError(
            "mode: sft trains on chat data for sft.steps steps; set sft.steps >= 1 and "
            "data.train (e.g. {type: jsonl, path: chat.jsonl, input_key: messages, "
            "label_key: null, apply_chat_template: true})."
        )
    if cfg.rl.steps == 0 and cfg.sft.steps == 0:
        raise ConfigError(
            "rl.steps: 0 with sft.steps: 0 would run nothing; set rl.steps >= 1 (or sft.steps "
            ">= 1 for a warm-up-only run)."
        )
    if cfg.runtime.generator_process and cfg.runtime.type != "local":
        raise ConfigError(
            "runtime.generator_process: runs the generator in a child process on the local "
            "runtime; on the ray runtime generators are actors already, so remove it."
        )
    if cfg.rl.partial_rollouts and not (cfg.rl.async_generation and cfg.rl.max_staleness >= 1):
        raise ConfigError(
            "rl.partial_rollouts: needs rl.async_generation: true and rl.max_staleness >= 1 "
            "(weights change during a round only when generation runs ahead of training); "
            "set both or turn partial_rollouts off."
        )
    if cfg.rl.async_mode == "continuous" and not (
        cfg.rl.async_generation and cfg.rl.max_staleness >= 1
    ):
        raise ConfigError(
            "rl.async_mode: 'continuous' generates while the trainer trains, so it needs "
            "rl.async_generation: true and rl.max_staleness >= 1; set both or use "
            "rl.async_mode: lockstep."
        )
    if cfg.rollout.prompts_per_step % cfg.rl.mini_batches_per_step:
        raise ConfigError(
            f"rl.mini_batches_per_step: {cfg.rl.mini_batches_per_step} does not divide "
            f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}); mini-batches are whole "
            "groups, so choose a divisor."
        )
    _default_stale_correction(cfg)
    if cfg.algorithm.aggregation == "constant" and cfg.algorithm.aggregation_constant is None:
        cfg.algorithm.aggregation_constant = float(cfg.rollout.sampling.max_new_tokens)
    overlong = cfg.rollout.overlong_penalty
    max_new = cfg.rollout.sampling.max_new_tokens
    if overlong is not None and overlong.max_length is None and overlong.band > max_new:
        raise ConfigError(
            f"rollout.overlong_penalty.band: {overlong.band} exceeds "
            f"rollout.sampling.max_new_tokens ({max_new}), the default max_length; lower the "
            "band or set overlong_penalty.max_length."
        )
    _check_eval(cfg.eval)
    if cfg.algorithm.advantage == "gae" and cfg.critic is None:
        raise ConfigError(
            "algorithm.advantage: 'gae' needs critic values; set critic (e.g. {type: hf}) or "
            "use a critic-free estimator (grpo, rloo, reinforce_pp)."
        )
    if cfg.critic is not None and cfg.algorithm.advantage != "gae":
        raise ConfigError(
            f"critic: set, but algorithm.advantage is {cfg.algorithm.advantage!r}, which does "
            "not use values; use algorithm.advantage: gae or remove critic."
        )
    if "max_staleness" in cfg.buffer.options:
        raise ConfigError(
            "buffer.max_staleness: the trainer bounds staleness itself; set rl.max_staleness "
            "instead and remove buffer.max_staleness."
        )
    if cfg.runtime.offload_policy and (
        cfg.runtime.layout != "colocated" or cfg.rl.async_generation
    ):
        raise ConfigError(
            "runtime.offload_policy: the colocated hand-over needs runtime.layout: colocated "
            f"and the synchronous loop (got layout {cfg.runtime.layout!r}, rl.async_generation "
            f"{cfg.rl.async_generation}); set both or turn offload_policy off."
        )
    _check_light_components(cfg)
    return cfg


def _default_stale_correction(cfg: TrainerConfig) -> None:
    """Asynchronous generation trains on tokens up to ``rl.max_staleness`` versions old: unless
    the recipe chooses ``algorithm.loss.correction`` itself, weigh them by truncated importance
    sampling (``tis``: the ratio of the trainer's to the behaviour policy's log-probs, clipped at
    2), the correction slime, verl and AReaL apply to stale rollouts. Measured on the Ray test
    recipe (``benchmarks/results/learning_margins.json``): with staleness 1 the training-reward
    gain over 30 steps rose from 0.037 to 0.053 (the synchronous run's 0.052), seeds 1-5.
    Left off when the sampling truncates (``top_p``/``top_k``): whether the generator's log-probs
    are renormalised is a generator property the config cannot see; set ``correction`` there."""
    if not (cfg.rl.async_generation and cfg.rl.max_staleness >= 1):
        return
    if "correction" in cfg.algorithm.loss:
        return
    s = cfg.rollout.sampling
    if truncates(s.top_p, s.top_k):
        return
    cfg.algorithm.loss = {**cfg.algorithm.loss, "correction": "tis"}


def _inside(path: Any, directory: Path) -> bool:
    """Whether ``path`` (a string as a recipe gives it) resolves inside ``directory``."""
    return isinstance(path, str) and bool(path) and absolute_path(path).is_relative_to(directory)


def _check_light_components(cfg: TrainerConfig) -> None:
    """Resolve the components that are cheap to import and check their options (types, ranges,
    data paths), so a typo fails at load rather than after the model is built. The model
    backends (policy, generator, critic, weight transport) are checked by the trainer once it
    knows the start weights they need."""
    specs: list[tuple[str, ComponentSpec | None, str, dict[str, Any]]] = [
        ("data_source", cfg.data.train, "data.train", {"seed": cfg.seed}),
        ("data_source", cfg.data.eval, "data.eval", {}),
        ("task", cfg.task, "task", {}),
        ("reward", cfg.reward, "reward", {}),
        ("reward", cfg.group_reward, "group_reward", {}),
        ("buffer", cfg.buffer, "buffer", {}),
        ("generate_fn", cfg.rollout.generate_fn, "rollout.generate_fn", {}),
    ]
    specs += [("filter", f, f"rollout.filters[{i}]", {}) for i, f in enumerate(cfg.rollout.filters)]
    specs += [
        ("data_source", ds.data, f"eval.datasets[{i}].data", {})
        for i, ds in enumerate(cfg.eval.datasets)
    ]
    run_dir = Path(cfg.run_dir).absolute()
    for kind, spec, where, defaults in specs:
        if spec is None or (kind == "data_source" and _inside(spec.options.get("path"), run_dir)):
            continue  # data the run writes itself (a task's splits) is checked when it is read
        obj = registry.resolve(registry.GROUPS[kind], spec.type, field=f"{where}.type")
        config_cls = getattr(obj, "Config", None) if isinstance(obj, type) else None
        if config_cls is not None:
            known = {f.name for f in dataclasses.fields(config_cls)}
            options = {**{k: v for k, v in defaults.items() if k in known}, **spec.options}
            from_dict(config_cls, options, path=where)
    # The algorithm's and the tiny model's settings, as the trainer reads them.
    from rl_core.algorithms import ADVANTAGE_ESTIMATORS, PolicyLoss, ValueLoss
    from rl_hf.tiny import TinyModelSpec

    alg = cfg.algorithm
    est = ADVANTAGE_ESTIMATORS.get(alg.advantage) or registry.resolve(
        registry.GROUPS["advantage"], alg.advantage, field="algorithm.advantage"
    )
    if isinstance(est, type) and hasattr(est, "Config"):
        from_dict(est.Config, alg.advantage_options, path="algorithm.advantage_options")
    from_dict(PolicyLoss.Config, alg.loss, path="algorithm.loss")
    from_dict(ValueLoss.Config, alg.value_loss, path="algorithm.value_loss")
    if cfg.model.init is not None:
        from_dict(TinyModelSpec, {"seed": cfg.seed, **cfg.model.init}, path="model.init")


def _check_eval(ev: EvalConfig) -> None:
    """Validate the eval section: pass@k within n_samples, no repeated samples under greedy
    decoding, unique dataset names."""
    seen: set[str] = set()
    sets: list[tuple[str, int, list[int], float | None]] = [
        ("eval", ev.n_samples, ev.pass_k, ev.sampling.temperature)
    ]
    for i, ds in enumerate(ev.datasets):
        where = f"eval.datasets[{i}]"
        if not ds.name or "/" in ds.name or ds.name in seen or ds.name == "eval":
            raise ConfigError(
                f"{where}.name: {ds.name!r} must be a non-empty, unique name without '/'."
            )
        seen.add(ds.name)
        n = ds.n_samples if ds.n_samples is not None else ev.n_samples
        ks = ds.pass_k if ds.pass_k is not None else ev.pass_k
        temperature = ds.sampling.temperature
        if temperature is None:
            temperature = ev.sampling.temperature
        sets.append((where, n, ks, temperature))
    for where, n, ks, temperature in sets:
        if n < 1:
            raise ConfigError(f"{where}.n_samples: must be >= 1, got {n}.")
        bad = [k for k in ks if not 1 <= k <= n]
        if bad:
            raise ConfigError(
                f"{where}.pass_k: {bad} outside 1..n_samples ({n}); raise n_samples or drop them."
            )
        if n > 1 and not temperature:
            why = "the eval default" if temperature is None else "set to 0"
            raise ConfigError(
                f"{where}.n_samples: {n} samples per prompt under greedy decoding "
                f"({where}.sampling.temperature is {why}) are {n} copies of one answer, so "
                f"pass@k for k > 1 would equal pass@1 and the extra samples cost time for "
                f"nothing. Set {where}.sampling.temperature above 0 (e.g. the training "
                f"temperature) to evaluate the sampled policy, or set {where}.n_samples: 1 "
                "(and pass_k: [1])."
            )
