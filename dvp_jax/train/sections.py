"""The sections of an experiment config as frozen, validated dataclasses (all but model, mesh
and loss, which their own packages define).

Each section checks its own fields on construction, naming the field (`config.train.group_size`)
and the allowed values; a generated task's knobs are checked by the task itself
(`DataConfig.arithmetic` / `running_sum`). Not here: the evaluation sections
(`eval_sections.py`), reading a ConfigDict and the checks across sections
(`config.ExperimentConfig.from_config_dict`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dvp_jax import trackers as trackers_lib
from dvp_jax.data import rewards as rewards_lib
from dvp_jax.data import running_sum
from dvp_jax.data.chat import CHAT_FORMATS
from dvp_jax.data.math_data import RowFields
from dvp_jax.data.running_sum import RunningSumTask
from dvp_jax.data.tail_sum import TailSumTask
from dvp_jax.data.tasks import ArithmeticTask, GeneratedTask
from dvp_jax.model.config import (
    ATTENTION_IMPLS,
    REMAT_POLICIES,
    TRAIN_PRECISIONS,
)
from dvp_jax.rollout.state import EngineConfig

# The engine's defaults: the run's rollout section takes them (`RolloutConfig`).
_ENGINE = EngineConfig()

# The generated tasks by `data.task` name; "math" reads a file instead.
GENERATED_TASKS = {
    "arithmetic": ArithmeticTask,
    "running_sum": RunningSumTask,
    "tail_sum": TailSumTask,
}
# The generated tasks written in the running-sum word vocabulary (`running_sum:<n_words>`).
WORD_TASKS = ("running_sum", "tail_sum")
TASKS = (*GENERATED_TASKS, "math")
# The reward of each task when `data.rewards` is "" (`dvp_jax.data.rewards` built-ins).
TASK_REWARDS = {
    "arithmetic": "exact_match",
    "running_sum": "marked_answer",
    "tail_sum": "marked_answer",
    "math": "math_verify",
}


def task_knobs(cls) -> dict[str, Any]:
    """A generated task's knobs and their defaults: its dataclass fields but `seed`."""
    return {f.name: field_default(f) for f in dataclasses.fields(cls) if f.name != "seed"}


def check_field(cond: bool, field: str, allowed: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"config.{field} must be {allowed}, got {value!r}")


def check_int(field: str, value: Any, lo: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (lo is None or value >= lo)
    check_field(ok, field, f"an int >= {lo}" if lo is not None else "an int", value)


def check_one_of(field: str, value: Any, allowed) -> None:
    check_field(value in allowed, field, f"one of {tuple(allowed)}", value)


def check_pos_float(field: str, value: Any, allow_zero: bool = False) -> None:
    ok = (
        isinstance(value, int | float)
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    check_field(ok, field, "a finite float " + (">= 0" if allow_zero else "> 0"), value)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The inference side: the rollout engine's precision, sampling, lengths and slots.

    Its fields are `EngineConfig` fields, under their names, with their defaults and their
    validation (`EngineConfig.check_fields`, naming `config.rollout.<field>`): one home each.
    `build.engine_config` makes the engine's config from this section, the data's prompt
    length, the loss's min-p rule and the run's seed (the engine's other fields), in one place.
    `tensor_parallel` is the run's own: the engine's mesh, (1, 1, tensor_parallel) local devices.
    """

    dtype: str = _ENGINE.dtype  # one of PRECISIONS; float32 turns the precision mismatch off
    noise_std: float = _ENGINE.noise_std  # std of additive Gaussian logit noise (experiments)
    # > 0: a synthetic tail-shaped noise (rollout/sampling.py): noise_std scaled per token by
    # clip((gap - G/2) / (G/2), 0, 1), gap = its distance below the row max (tempered logits).
    noise_tail_gap: float = _ENGINE.noise_tail_gap
    temperature: float = _ENGINE.temperature
    max_decode_length: int = _ENGINE.max_decode_length  # most tokens generated per response
    max_concurrent_decodes: int = _ENGINE.max_concurrent_decodes  # decode slots of the engine
    # Decode attention and its paged KV cache: "paged" | "paged_xla" | "dense", positions per
    # page, pages in the pool (None: every slot at full length).
    decode_attention: str = _ENGINE.decode_attention
    page_size: int = _ENGINE.page_size
    kv_pages: int | None = _ENGINE.kv_pages
    # Truncation (E13, rollout/sampling.py; off by default, the paper samples with min-p only):
    # keep the top_k highest tokens (0: off), then the smallest top set of probability >= top_p
    # (1: off), among at most max_kept tokens, whose ids the trainer receives per token.
    top_k: int = _ENGINE.top_k
    top_p: float = _ENGINE.top_p
    max_kept: int = _ENGINE.max_kept
    tensor_parallel: int = 1
    # Partial rollouts (rollout/partial.py; off: the paper's fully on-policy setting): a step
    # takes the first P groups whose responses all finished, with up to oversample x P groups
    # in flight, and carries the unfinished ones into the next step; a response holding a
    # token older than max_staleness weight versions is decoded again from its prompt.
    partial: bool = False
    oversample: float = 3.0
    max_staleness: int = 4

    def __post_init__(self):
        EngineConfig.check_fields(self, "config.rollout")
        check_int("rollout.tensor_parallel", self.tensor_parallel, 1)
        check_field(isinstance(self.partial, bool), "rollout.partial", "a bool", self.partial)
        ok = isinstance(self.oversample, int | float) and not isinstance(self.oversample, bool)
        ok = ok and math.isfinite(self.oversample) and self.oversample >= 1
        check_field(ok, "rollout.oversample", "a finite float >= 1", self.oversample)
        check_int("rollout.max_staleness", self.max_staleness, 0)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The prompts and their reward: a generated task (`GENERATED_TASKS`) or a math file.

    `arithmetic` and `running_sum` hold each generated task's knobs under the task's own field
    names (`ArithmeticTask`, `RunningSumTask`; their seed is `data.seed`); the task owns their
    defaults and checks. Unset knobs take the task's defaults; both tasks are built (checked)
    whichever `task` runs, and `make_task()` returns the one that does.
    """

    task: str = "arithmetic"  # one of TASKS
    # jsonl / parquet / datasets save_to_disk directory, for task="math"
    path: str = ""
    # held-out math file (e.g. AIME25) for avg@k (eval_accuracy); generated tasks have a split.
    # More named sets: eval.sets.
    eval_path: str = ""
    # The fields of a math row (`math_data.RowFields`; "a.b" reaches into an object): the prompt
    # (a string or chat messages), the ground truth, an optional system prompt. "": the
    # DAPO-Math layout (prompt / problem / question; reward_model.ground_truth / answer; none).
    prompt_key: str = ""
    answer_key: str = ""
    system_key: str = ""
    # "char", "running_sum:<n_words>" (task="running_sum"), a path to a tokenizer.json (or its
    # directory) or a Hub repo id (resolved like model.hf_path, e.g. the same id)
    tokenizer: str = "char"
    # How chat-message prompts become text (CHAT_FORMATS, `dvp_jax.data.chat`): "auto" the
    # tokenizer's own chat_template, else ChatML; "chatml" always ChatML; "plain" the contents.
    chat_format: str = "auto"
    max_prompt_len: int = 16
    seed: int = 0
    arithmetic: dict = dataclasses.field(default_factory=dict)
    running_sum: dict = dataclasses.field(default_factory=dict)
    tail_sum: dict = dataclasses.field(default_factory=dict)
    # Weighted reward terms "name[=weight],..." (`dvp_jax.data.rewards.parse_rewards`), e.g.
    # "math_verify=1.0,math_format=0.1,my_pkg.my_mod:my_fn=0.5"; "" is the task's verifier
    # (TASK_REWARDS).
    rewards: str = ""

    def __post_init__(self):
        check_one_of("data.task", self.task, TASKS)
        check_one_of("data.chat_format", self.chat_format, CHAT_FORMATS)
        for key in ("prompt_key", "answer_key", "system_key"):
            value = getattr(self, key)
            check_field(isinstance(value, str), f"data.{key}", "a string", value)
        if self.task == "math":
            check_field(
                bool(self.path), "data.path", "a jsonl/parquet file path for task='math'", self.path
            )
        check_int("data.max_prompt_len", self.max_prompt_len, 1)
        check_int("data.seed", self.seed, 0)
        built = {name: self._build_task(name, cls) for name, cls in GENERATED_TASKS.items()}
        object.__setattr__(self, "_tasks", built)  # not a field: derived from the knobs
        self._check_tokenizer(built.get(self.task, built["running_sum"]))
        check_field(isinstance(self.rewards, str), "data.rewards", "a string", self.rewards)
        try:  # user functions are imported here, before any work
            terms = rewards_lib.parse_rewards(self.reward_spec)
        except ValueError as e:
            raise ValueError(f"config.data.rewards: {e}") from None
        object.__setattr__(self, "_reward_terms", terms)  # not a field: parsed from `rewards`

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

    def _check_tokenizer(self, rs_task: RunningSumTask | TailSumTask) -> None:
        """A word task (`WORD_TASKS`) needs its word tokenizer, and the word tokenizer nothing
        else."""
        if self.task not in WORD_TASKS:
            word_tokenizer = self.tokenizer.split(":")[0] == running_sum.TOKENIZER_NAME
            check_field(
                not word_tokenizer,
                "data.tokenizer",
                f"'char' or a tokenizer.json path for task={self.task!r} (the running-sum word "
                "tokenizer cannot encode its prompts)",
                self.tokenizer,
            )
            return
        spec = rs_task.tokenizer_spec
        default_words = rs_task.n_words == running_sum.DEFAULT_N_WORDS
        check_field(
            self.tokenizer == spec
            or (self.tokenizer == running_sum.TOKENIZER_NAME and default_words),
            "data.tokenizer",
            f"{spec!r} for task={self.task!r} (the word vocabulary of "
            f"data.{self.task}.n_words={rs_task.n_words})",
            self.tokenizer,
        )
        least = rs_task.max_prompt_tokens + 1
        check_field(
            self.max_prompt_len >= least,
            "data.max_prompt_len",
            f">= {least} (BOS and the longest prompt of data.{self.task})",
            self.max_prompt_len,
        )

    @property
    def reward_spec(self) -> str:
        """`rewards`, or the task's verifier (TASK_REWARDS) when it is ""."""
        return self.rewards or TASK_REWARDS[self.task]

    @property
    def verifier(self) -> str:
        """The task's answer check (TASK_REWARDS): what held-out accuracy is scored by, whatever
        shaping or penalty terms `rewards` adds to the training reward."""
        return TASK_REWARDS[self.task]

    @property
    def reward_terms(self) -> tuple[rewards_lib.RewardTerm, ...]:
        """The parsed terms of `reward_spec` (`rewards_lib.parse_rewards`)."""
        return self._reward_terms

    @property
    def fields(self) -> RowFields:
        """Where a math row's prompt, answer and system prompt are (`prompt_key`, ...)."""
        return RowFields(self.prompt_key, self.answer_key, self.system_key)

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
    # Micro-batches per update (gradient accumulation): the update's rows (`packing.Layout`)
    # are cut into this many model calls; one holding no response token is skipped.
    micro_batches: int = 1
    # Several (prompt + response) sequences per row of the update, each with its own segment
    # id and positions (train/packing.py); False: one per row, padded to the longest (slower;
    # kept for comparison).
    packing: bool = True
    # Tokens per row of the update; 0: data.max_prompt_len + rollout.max_decode_length (a row
    # must hold the longest sequence).
    row_length: int = 0
    # Leave the responses of groups whose G rewards are all equal (RLOO advantage 0 for every
    # one) out of the update, as DAPO's dynamic sampling does (without its resampling). Their
    # policy-gradient terms are exactly 0, so what changes is the normaliser Z (E9), then over
    # the trained responses only, as in DAPO, and the loss-side diagnostics, which cover the
    # trained responses. Not with a KL or entropy term (they give those responses a gradient).
    # With rollout.partial the over-sampling resamples too: a zero-advantage group is dropped
    # and a later complete group takes its place, so the update stays full (DAPO's dynamic
    # sampling; partial_groups_per_trained logs the cost).
    skip_zero_advantage: bool = False
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
    # Where the numbers and sample generations go besides metrics.jsonl / samples.jsonl
    # (`dvp_jax.trackers.TRACKERS`, comma-separated): "tensorboard" (event files in the
    # workdir), "wandb" (Weights & Biases: pip install 'dvp_jax[wandb]'), "" (neither).
    trackers: str = "tensorboard"
    # The W&B run: "" leaves each to W&B (WANDB_ENTITY, WANDB_MODE, ...); the name defaults to
    # the workdir's; wandb_mode one of trackers.WANDB_MODES.
    wandb_project: str = "dvp_jax"
    wandb_entity: str = ""
    wandb_name: str = ""
    wandb_mode: str = ""

    def __post_init__(self):
        trackers_lib.parse_trackers(self.trackers)  # raises naming config.train.trackers
        for key in ("wandb_project", "wandb_entity", "wandb_name"):
            value = getattr(self, key)
            check_field(isinstance(value, str), f"train.{key}", "a string", value)
        check_one_of("train.wandb_mode", self.wandb_mode, trackers_lib.WANDB_MODES)
        check_int("train.steps", self.steps, 0)
        check_int("train.prompts_per_step", self.prompts_per_step, 1)
        check_int("train.group_size", self.group_size, 2)
        check_pos_float("train.learning_rate", self.learning_rate)
        check_int("train.warmup_steps", self.warmup_steps, 0)
        check_pos_float("train.weight_decay", self.weight_decay, allow_zero=True)
        check_pos_float("train.grad_clip", self.grad_clip)
        check_int("train.micro_batches", self.micro_batches, 1)
        check_field(isinstance(self.packing, bool), "train.packing", "a bool", self.packing)
        check_int("train.row_length", self.row_length, 0)
        check_field(
            isinstance(self.skip_zero_advantage, bool),
            "train.skip_zero_advantage",
            "a bool",
            self.skip_zero_advantage,
        )
        check_int("train.updates_per_batch", self.updates_per_batch, 1)
        check_int("train.chunk_size", self.chunk_size, 1)
        check_field(
            isinstance(self.attention_block, int)
            and self.attention_block >= 0
            and self.attention_block % 128 == 0,
            "train.attention_block",
            "0 (choose) or a positive multiple of 128",
            self.attention_block,
        )
        check_one_of("train.precision", self.precision, TRAIN_PRECISIONS)
        check_one_of("train.remat", self.remat, REMAT_POLICIES)
        check_one_of("train.attention_impl", self.attention_impl, ATTENTION_IMPLS)
        check_int("train.seed", self.seed, 0)

    @property
    def tracker_names(self) -> tuple[str, ...]:
        """`trackers` as names (`trackers.parse_trackers`, checked in `__post_init__`)."""
        return trackers_lib.parse_trackers(self.trackers)

    @property
    def wandb(self) -> trackers_lib.WandbOptions:
        return trackers_lib.WandbOptions(
            self.wandb_project, self.wandb_entity, self.wandb_name, self.wandb_mode
        )


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-up on the generated task, before RL (0 steps: off)."""

    steps: int = 0
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 20

    def __post_init__(self):
        check_int("sft.steps", self.steps, 0)
        check_int("sft.batch_size", self.batch_size, 1)
        check_pos_float("sft.learning_rate", self.learning_rate)
        check_int("sft.warmup_steps", self.warmup_steps, 0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 10  # 0: only at the end (and on SIGTERM)
    keep: int = 3

    def __post_init__(self):
        check_int("checkpoint.every", self.every, 0)
        check_int("checkpoint.keep", self.keep, 1)


def field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None
