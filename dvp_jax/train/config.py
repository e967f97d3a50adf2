"""Experiment configuration: an `ml_collections.ConfigDict` converted once into frozen dataclasses.

`configs/*.py` return ConfigDicts (so absl `config_flags` can apply `--config.a.b=value`
overrides). `ExperimentConfig.from_config_dict` validates every value once; below the trainer
boundary nothing reads a ConfigDict. Errors name the field (`config.train.group_size`) and the
allowed values.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import ml_collections

from dvp_jax.data import running_sum
from dvp_jax.data.running_sum import RunningSumTask
from dvp_jax.data.tasks import ArithmeticTask, GeneratedTask
from dvp_jax.dvp.losses import PRESETS as LOSS_PRESETS
from dvp_jax.dvp.losses import LossConfig
from dvp_jax.model.config import (
    ATTENTION_IMPLS,
    PRECISIONS,
    REMAT_POLICIES,
    TRAIN_PRECISIONS,
    DTypePolicy,
    ModelConfig,
)
from dvp_jax.model.config import PRESETS as MODEL_PRESETS
from dvp_jax.sharding import MeshConfig

# The generated tasks by `data.task` name; "math" reads a file instead.
GENERATED_TASKS = {"arithmetic": ArithmeticTask, "running_sum": RunningSumTask}
TASKS = (*GENERATED_TASKS, "math")
# The verifier of each task (`dvp_jax.data.rewards` kinds).
TASK_REWARDS = {"arithmetic": "exact_match", "running_sum": "marked_answer", "math": "math_verify"}


def task_knobs(cls) -> dict[str, Any]:
    """A generated task's knobs and their defaults: its dataclass fields but `seed`."""
    return {f.name: _default(f) for f in dataclasses.fields(cls) if f.name != "seed"}


def _check(cond: bool, field: str, allowed: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"config.{field} must be {allowed}, got {value!r}")


def _int(field: str, value: Any, lo: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (lo is None or value >= lo)
    _check(ok, field, f"an int >= {lo}" if lo is not None else "an int", value)


def _pos_float(field: str, value: Any, allow_zero: bool = False) -> None:
    ok = (
        isinstance(value, int | float)
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    _check(ok, field, "a finite float " + (">= 0" if allow_zero else "> 0"), value)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The inference side: JetStream engine precision and sampling.

    Field names are `EngineConfig`'s (and JetStream's Engine properties'), so one vocabulary
    runs from the config file to the engine.
    """

    dtype: str = "bfloat16"  # one of PRECISIONS; float32 turns the precision mismatch off
    noise_std: float = 0.0  # std of additive Gaussian logit noise before pruning (experiments)
    # > 0: a synthetic tail-shaped noise (rollout/sampling.py): noise_std scaled per token by
    # clip((gap - G/2) / (G/2), 0, 1), gap = its distance below the row max (tempered logits).
    noise_tail_gap: float = 0.0
    temperature: float = 1.0
    max_decode_length: int = 8  # most tokens generated per response
    max_concurrent_decodes: int = 64  # decode slots of the engine
    tensor_parallel: int = 1  # the engine's mesh: (1, 1, tensor_parallel) local devices

    def __post_init__(self):
        _check(self.dtype in PRECISIONS, "rollout.dtype", f"one of {PRECISIONS}", self.dtype)
        _pos_float("rollout.noise_std", self.noise_std, allow_zero=True)
        _pos_float("rollout.noise_tail_gap", self.noise_tail_gap, allow_zero=True)
        _pos_float("rollout.temperature", self.temperature)
        _int("rollout.max_decode_length", self.max_decode_length, 1)
        _int("rollout.max_concurrent_decodes", self.max_concurrent_decodes, 1)
        _int("rollout.tensor_parallel", self.tensor_parallel, 1)

    @property
    def policy(self) -> DTypePolicy:
        return DTypePolicy.named(self.dtype)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The prompts and their verifier: a generated task (`GENERATED_TASKS`) or a math file.

    `arithmetic` and `running_sum` hold each generated task's knobs under the task's own field
    names (`ArithmeticTask`, `RunningSumTask`; their seed is `data.seed`); the task owns their
    defaults and checks. Unset knobs take the task's defaults; both tasks are built (checked)
    whichever `task` runs, and `make_task()` returns the one that does.
    """

    task: str = "arithmetic"  # one of TASKS; the reward kind follows (TASK_REWARDS)
    path: str = ""  # jsonl / parquet in the DAPO-Math layout, for task="math"
    eval_path: str = ""  # held-out math file (e.g. AIME25) for avg@k; generated tasks have a split
    # "char", "running_sum:<n_words>" (task="running_sum") or a path to a tokenizer.json
    tokenizer: str = "char"
    chat_format: str = "chatml"
    max_prompt_len: int = 16
    seed: int = 0
    arithmetic: dict = dataclasses.field(default_factory=dict)
    running_sum: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _check(self.task in TASKS, "data.task", f"one of {TASKS}", self.task)
        if self.task == "math":
            _check(
                bool(self.path), "data.path", "a jsonl/parquet file path for task='math'", self.path
            )
        _int("data.max_prompt_len", self.max_prompt_len, 1)
        _int("data.seed", self.seed, 0)
        built = {name: self._build_task(name, cls) for name, cls in GENERATED_TASKS.items()}
        object.__setattr__(self, "_tasks", built)  # not a field: derived from the knobs
        self._check_tokenizer(built["running_sum"])

    def _build_task(self, name: str, cls):
        """The task of `data.<name>`'s knobs; the knob dict is completed with its defaults."""
        knobs, allowed = dict(getattr(self, name)), task_knobs(cls)
        unknown = sorted(set(knobs) - set(allowed))
        if unknown:
            raise ValueError(
                f"config.data.{name} has unknown fields {unknown}; allowed: {sorted(allowed)}"
            )
        try:
            task = cls(seed=self.seed, **knobs)
        except (TypeError, ValueError) as e:  # the task's own message names its field
            raise ValueError(f"config.data.{name}: {e}") from None
        object.__setattr__(self, name, {k: getattr(task, k) for k in allowed})
        return task

    def _check_tokenizer(self, rs_task: RunningSumTask) -> None:
        """The running-sum task needs its word tokenizer, and the word tokenizer nothing else."""
        if self.task != "running_sum":
            word_tokenizer = self.tokenizer.split(":")[0] == running_sum.TOKENIZER_NAME
            _check(
                not word_tokenizer,
                "data.tokenizer",
                f"'char' or a tokenizer.json path for task={self.task!r} (the running-sum word "
                "tokenizer cannot encode its prompts)",
                self.tokenizer,
            )
            return
        spec = rs_task.tokenizer_spec
        default_words = rs_task.n_words == running_sum.DEFAULT_N_WORDS
        _check(
            self.tokenizer == spec
            or (self.tokenizer == running_sum.TOKENIZER_NAME and default_words),
            "data.tokenizer",
            f"{spec!r} for task='running_sum' (the word vocabulary of "
            f"data.running_sum.n_words={rs_task.n_words})",
            self.tokenizer,
        )
        least = rs_task.max_prompt_tokens + 1
        _check(
            self.max_prompt_len >= least,
            "data.max_prompt_len",
            f">= {least} (BOS and the longest prompt of data.running_sum)",
            self.max_prompt_len,
        )

    @property
    def reward_kind(self) -> str:
        """The verifier of the task (TASK_REWARDS)."""
        return TASK_REWARDS[self.task]

    def make_task(self) -> GeneratedTask | None:
        """The generated task `task` names, or None for "math": the same problems and held-out
        split everywhere (trainer, experiments, evaluation)."""
        return self._tasks.get(self.task)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    # P: prompts per rollout batch (the global generation batch; each of H hosts rolls out P/H)
    prompts_per_step: int = 8
    group_size: int = 8  # G: responses per prompt (E8 needs G >= 2)
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    micro_batches: int = 1  # gradient accumulation
    updates_per_batch: int = 1  # > 1 uses the decoupled PPO clip (loss.ppo_clip_eps)
    chunk_size: int = 8192  # vocabulary chunk of the pruned logprobs
    # The trainer's dtype policy (TRAIN_PRECISIONS): "float32" is true fp32 (every matmul at
    # `highest`); "mixed_bf16" computes in bf16 with fp32 params, logits and loss (speed).
    precision: str = "float32"
    # Full-sequence attention kernel (ATTENTION_IMPLS): "auto" picks cuDNN on GPU / splash on
    # TPU for bf16 compute and the explicit XLA path otherwise (always for float32).
    attention_impl: str = "auto"
    # The splash kernel's query / key tile (a multiple of 128 dividing T); 0 picks the largest
    # of 512, 256, 128 that divides T (`DTypePolicy.attention_block`).
    attention_block: int = 0
    # Rematerialise the block activations in the backward pass (REMAT_POLICIES): "none",
    # "full" (long responses), or keep the matmul outputs ("save_dots", "save_dots_no_batch").
    remat: str = "none"
    seed: int = 0

    def __post_init__(self):
        _int("train.steps", self.steps, 0)
        _int("train.prompts_per_step", self.prompts_per_step, 1)
        _int("train.group_size", self.group_size, 2)
        _pos_float("train.learning_rate", self.learning_rate)
        _int("train.warmup_steps", self.warmup_steps, 0)
        _pos_float("train.weight_decay", self.weight_decay, allow_zero=True)
        _pos_float("train.grad_clip", self.grad_clip)
        _int("train.micro_batches", self.micro_batches, 1)
        _int("train.updates_per_batch", self.updates_per_batch, 1)
        _int("train.chunk_size", self.chunk_size, 1)
        _check(
            isinstance(self.attention_block, int)
            and self.attention_block >= 0
            and self.attention_block % 128 == 0,
            "train.attention_block",
            "0 (choose) or a positive multiple of 128",
            self.attention_block,
        )
        _check(
            self.precision in TRAIN_PRECISIONS,
            "train.precision",
            f"one of {TRAIN_PRECISIONS}",
            self.precision,
        )
        _check(self.remat in REMAT_POLICIES, "train.remat", f"one of {REMAT_POLICIES}", self.remat)
        _check(
            self.attention_impl in ATTENTION_IMPLS,
            "train.attention_impl",
            f"one of {ATTENTION_IMPLS}",
            self.attention_impl,
        )
        _int("train.seed", self.seed, 0)
        batch = self.prompts_per_step * self.group_size
        _check(
            batch % self.micro_batches == 0,
            "train.micro_batches",
            f"a divisor of prompts_per_step * group_size = {batch}",
            self.micro_batches,
        )


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-up on the generated task, before RL (0 steps: off)."""

    steps: int = 0
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 20

    def __post_init__(self):
        _int("sft.steps", self.steps, 0)
        _int("sft.batch_size", self.batch_size, 1)
        _pos_float("sft.learning_rate", self.learning_rate)
        _int("sft.warmup_steps", self.warmup_steps, 0)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 10  # 0: only at the start and the end of RL
    num_prompts: int = 128
    k: int = 4  # avg@k: k samples per held-out prompt
    # Sample the evaluation with rollout.noise_std too (False: the policy at rollout precision,
    # noise being a mismatch knob of the experiments rather than part of the policy).
    with_rollout_noise: bool = False
    # Precision of the evaluation engine: "" evaluates with the rollout engine (its precision);
    # one of PRECISIONS builds a second engine at that precision (e.g. "float32": held-out
    # accuracy of the policy itself, free of the rollout mismatch).
    dtype: str = ""

    def __post_init__(self):
        _check(
            self.dtype in ("",) + PRECISIONS, "eval.dtype", f"'' or one of {PRECISIONS}", self.dtype
        )
        _int("eval.every", self.every, 0)
        _int("eval.num_prompts", self.num_prompts, 1)
        _int("eval.k", self.k, 1)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 10  # 0: only at the end (and on SIGTERM)
    keep: int = 3

    def __post_init__(self):
        _int("checkpoint.every", self.every, 0)
        _int("checkpoint.keep", self.keep, 1)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig
    mesh: MeshConfig
    rollout: RolloutConfig
    loss: LossConfig
    method: str
    data: DataConfig
    train: TrainConfig
    sft: SFTConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    log_every: int = 1
    plots: bool = True
    init_hf_path: str = ""  # a local Hugging Face Qwen3 directory to start from (model.hf_path)

    @property
    def rollout_log_rho(self) -> float:
        """The rollout prunes with the same rule as the trainer (E1): -inf when pruning is off."""
        return self.loss.effective_log_rho

    @classmethod
    def from_config_dict(cls, cd: ml_collections.ConfigDict, vocab_size: int) -> ExperimentConfig:
        """Validates a ConfigDict once; `vocab_size` is the tokenizer's (model.vocab_size=-1).

        `None` (an unset placeholder of `default_config`) means "not set here": the model field
        comes from `model.preset`, the loss field from the method preset (or, for
        `loss.temperature`, from `rollout.temperature`).
        """
        d = cd.to_dict() if isinstance(cd, ml_collections.ConfigDict) else dict(cd)
        unknown = sorted(set(d) - set(_SECTIONS) - set(_TOP_LEVEL))
        if unknown:
            raise ValueError(
                f"config has unknown top-level fields {unknown}; "
                f"allowed: {sorted(set(_SECTIONS) | set(_TOP_LEVEL))}"
            )
        unset = lambda section: {k: v for k, v in dict(d.get(section, {})).items() if v is not None}

        model_d = unset("model")
        preset = model_d.pop("preset", "tiny")
        hf_path = model_d.pop("hf_path", "") or ""
        _check(preset in MODEL_PRESETS, "model.preset", f"one of {sorted(MODEL_PRESETS)}", preset)
        if model_d.get("vocab_size", -1) == -1:
            # Round the tokenizer's vocabulary up to a multiple of 8 so it shards evenly.
            model_d["vocab_size"] = -(-vocab_size // 8) * 8
        _check(
            model_d["vocab_size"] >= vocab_size,
            "model.vocab_size",
            f">= the tokenizer's vocabulary ({vocab_size})",
            model_d["vocab_size"],
        )
        # With model.hf_path the preset must describe the checkpoint; the trainer checks it
        # against the checkpoint's config.json when it loads the weights.
        model = _build("model", ModelConfig, model_d, base=MODEL_PRESETS[preset])

        method = d.get("method", "dvp")
        _check(method in LOSS_PRESETS, "method", f"one of {tuple(LOSS_PRESETS)}", method)
        rollout = _build("rollout", RolloutConfig, d.get("rollout", {}))
        # Both sides prune with the same rule (E1) after the same temperature.
        loss_fields = {"temperature": rollout.temperature, **LOSS_PRESETS[method], **unset("loss")}
        loss = _build("loss", LossConfig, loss_fields)
        train = _build("train", TrainConfig, d.get("train", {}))
        if train.updates_per_batch > 1 and loss.ppo_clip_eps is None:
            raise ValueError(
                "config.loss.ppo_clip_eps must be set (e.g. 0.2) when "
                f"config.train.updates_per_batch={train.updates_per_batch} > 1"
            )
        if train.updates_per_batch == 1 and loss.ppo_clip_eps is not None:
            raise ValueError("config.loss.ppo_clip_eps needs config.train.updates_per_batch > 1")
        data = _build("data", DataConfig, d.get("data", {}))
        longest = data.running_sum["max_response_len"]
        if data.task == "running_sum" and rollout.max_decode_length <= longest:
            # The reference responses run to max_response_len tokens plus EOS; a shorter decode
            # budget truncates them, and a truncated response scores 0.
            raise ValueError(
                "config.rollout.max_decode_length must be >= "
                f"data.running_sum.max_response_len + 1 = {longest + 1} for task='running_sum', "
                f"got {rollout.max_decode_length}"
            )
        cfg = cls(
            model=model,
            mesh=_build("mesh", MeshConfig, d.get("mesh", {})),
            rollout=rollout,
            loss=loss,
            method=method,
            data=data,
            train=train,
            sft=_build("sft", SFTConfig, d.get("sft", {})),
            eval=_build("eval", EvalConfig, d.get("eval", {})),
            checkpoint=_build("checkpoint", CheckpointConfig, d.get("checkpoint", {})),
            log_every=d.get("log_every", 1),
            plots=d.get("plots", True),
            init_hf_path=hf_path,
        )
        _int("log_every", cfg.log_every, 1)
        return cfg


# Sections of the ConfigDict and the dataclass each becomes.
_SECTIONS = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "rollout": RolloutConfig,
    "loss": LossConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sft": SFTConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
}
_TOP_LEVEL = ("method", "log_every", "plots")


def default_config(method: str = "dvp") -> ml_collections.ConfigDict:
    """Every field of every section with its default: the base each `configs/*.py` edits.

    The defaults live in the dataclasses above (and `ModelConfig` / `LossConfig`); a config
    file states only what differs. Fields whose value comes from a preset are typed
    placeholders (None = "from the preset"): every `ModelConfig` field (`model.preset`), the
    method preset's `loss.prune` / `loss.correction`, and `loss.temperature` (defaults to
    `rollout.temperature`). So every field exists, can be overridden from the command line with
    its type checked, and a misspelt override fails (the ConfigDict is locked by `main.py`).
    """
    c = ml_collections.ConfigDict()
    c.method = method or "dvp"  # rloo | tis | mis | dvp | mis_dvp (docs/design.md section 2)
    from_preset = {"model": {f.name for f in dataclasses.fields(ModelConfig)}}
    from_preset["loss"] = {"prune", "correction", "temperature"}
    for section, cls in _SECTIONS.items():
        c[section] = _fields_dict(cls, from_preset.get(section, ()))
    for name, cls in GENERATED_TASKS.items():  # each task's knobs under its own names
        c.data[name] = _fields_dict(cls, skip=("seed",))
    c.model.preset = "tiny"  # a ModelConfig preset name; the fields above override it
    c.model.vocab_size = -1  # -1: the tokenizer's vocabulary rounded up to a multiple of 8
    c.model.hf_path = ""  # a local Hugging Face Qwen3 directory to start from ("" = random init)
    for name in _TOP_LEVEL[1:]:
        c[name] = _default(next(f for f in dataclasses.fields(ExperimentConfig) if f.name == name))
    return c


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _fields_dict(cls, from_preset=(), skip=()) -> ml_collections.ConfigDict:
    """Dataclass `cls`'s fields with their defaults; a None default (or one `from_preset`) is a
    placeholder of the field's type (`float | None` -> float)."""
    sub = ml_collections.ConfigDict()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = None if f.name in from_preset else _default(f)
        if default is None:
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            default = ml_collections.config_dict.placeholder(args[0] if args else hints[f.name])
        sub[f.name] = default
    return sub


def _build(section: str, cls, values: dict[str, Any], base=None):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"config.{section} has unknown fields {unknown}; allowed: {sorted(names)}")
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except (TypeError, ValueError) as e:
        msg = str(e)
        if f"config.{section}" in msg:
            raise
        # Dataclass validators name their own class (`LossConfig.cap`); say where it was set.
        raise ValueError(f"config.{section}: {msg}") from None
