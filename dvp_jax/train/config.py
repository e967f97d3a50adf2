"""Experiment configuration: an `ml_collections.ConfigDict` converted once into frozen dataclasses.

`configs/*.py` return ConfigDicts (so absl `config_flags` can apply `--config.a.b=value`
overrides). `ExperimentConfig.from_config_dict` validates every value once; below the trainer
boundary nothing reads a ConfigDict. Errors name the field (`config.train.group_size`) and the
allowed values.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import ml_collections

from dvp_jax.dvp.losses import PRESETS as LOSS_PRESETS
from dvp_jax.dvp.losses import LossConfig
from dvp_jax.model.config import PRESETS as MODEL_PRESETS
from dvp_jax.model.config import ModelConfig
from dvp_jax.model.hub import checkpoint_config, resolve_model_dir
from dvp_jax.rollout.state import EngineConfig
from dvp_jax.sharding import MeshConfig
from dvp_jax.train.eval_sections import EvalConfig
from dvp_jax.train.sections import (
    GENERATED_TASKS,
    CheckpointConfig,
    DataConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
    check_field,
    check_int,
    check_one_of,
    field_default,
)


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
    init_hf_path: str = ""  # model.hf_path resolved: the local directory the weights are read from

    @classmethod
    def from_config_dict(
        cls, cd: ml_collections.ConfigDict, vocab_size: int, *, read_checkpoint: bool = True
    ) -> ExperimentConfig:
        """Validates a ConfigDict once; `vocab_size` is the tokenizer's (model.vocab_size=-1).

        `None` (an unset placeholder of `default_config`) means "not set here": the model field
        comes from `model.hf_path`'s config.json or `model.preset`, the loss field from the
        method preset (or, for `loss.temperature`, from `rollout.temperature`).
        `read_checkpoint=False` is for what validates or compiles a config away from its
        checkpoint (`aot` on a workstation, a sweep checked before its warm start exists): a
        `model.hf_path` that is not a local directory here is kept as written, unread, and the
        architecture is `model.preset`'s and the model fields', as without `hf_path`.
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
        preset = model_d.pop("preset", "") or ""  # "": "tiny", or with hf_path the file's
        hf_path = model_d.pop("hf_path", "") or ""
        if preset or not hf_path:
            check_one_of("model.preset", preset or "tiny", sorted(MODEL_PRESETS))
        # With read_checkpoint=False, a model.hf_path that is not a local directory here is kept
        # as written and unread: the architecture is the preset's ("tiny" if unset) and fields'.
        unread = not read_checkpoint and not os.path.isdir(os.path.expanduser(hf_path))
        if hf_path and not unread:
            # The architecture is the checkpoint's config.json (a local directory or a Hub
            # repo's snapshot, resolved once, here); a preset or a field stated too must agree.
            hf_path = resolve_model_dir(hf_path)
            if model_d.get("vocab_size") == -1:
                del model_d["vocab_size"]  # the checkpoint's embedding rows
            base = checkpoint_config(hf_path, preset, model_d)
        else:
            base = MODEL_PRESETS[preset or "tiny"]
            if model_d.get("vocab_size", -1) == -1:
                # Round the tokenizer's vocabulary up to a multiple of 8 so it shards evenly.
                model_d["vocab_size"] = -(-vocab_size // 8) * 8
        model = _build("model", ModelConfig, model_d, base=base)
        check_field(
            model.vocab_size >= vocab_size,
            "model.vocab_size",
            f">= the tokenizer's vocabulary ({vocab_size})",
            model.vocab_size,
        )

        method = d.get("method", "dvp")
        check_one_of("method", method, LOSS_PRESETS)
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
        if train.skip_zero_advantage and (loss.kl_coef > 0 or loss.entropy_coef > 0):
            raise ValueError(
                "config.train.skip_zero_advantage=True needs loss.kl_coef = 0 and "
                f"loss.entropy_coef = 0 (got {loss.kl_coef} and {loss.entropy_coef}): those terms "
                "give zero-advantage responses a gradient, so leaving them out would change it"
            )
        data = _build("data", DataConfig, d.get("data", {}))
        longest = data.running_sum["max_response_len"]
        what = "data.running_sum.max_response_len + 1"
        if data.task == "tail_sum":
            longest = data.make_task().max_response_len
            what = "the longest data.tail_sum response + 1"
        if data.task in ("running_sum", "tail_sum") and rollout.max_decode_length <= longest:
            # The reference responses run to max_response_len tokens plus EOS; a shorter decode
            # budget truncates them, and a truncated response scores 0.
            raise ValueError(
                f"config.rollout.max_decode_length must be >= {what} = {longest + 1} for "
                f"task={data.task!r}, got {rollout.max_decode_length}"
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
        check_int("log_every", cfg.log_every, 1)
        longest = cfg.sequence_length
        if train.row_length and train.row_length < longest:
            raise ValueError(
                f"config.train.row_length={train.row_length} is shorter than the longest "
                f"sequence, data.max_prompt_len + rollout.max_decode_length = "
                f"{data.max_prompt_len} + {rollout.max_decode_length} = {longest}: a row must "
                "hold it (0 picks that length)"
            )
        # The engine's pool rule, on the run's cache length (prompt + response).
        EngineConfig.check_kv_pages(rollout.kv_pages, longest, rollout.page_size, "config.rollout")
        return cfg

    @property
    def sequence_length(self) -> int:
        """The longest sequence a step holds: data.max_prompt_len + rollout.max_decode_length."""
        return self.data.max_prompt_len + self.rollout.max_decode_length


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


def default_config(method: str = "dvp", **sections: dict[str, Any]) -> ml_collections.ConfigDict:
    """Every field of every section with its default, then `sections`' values: what a
    `configs/*.py` returns, e.g. `default_config(method, train=dict(steps=250))`.

    The defaults live in the section dataclasses (`sections`, `ModelConfig`, `LossConfig`); a
    config file states only what differs, section by section (nested dicts for a task's knobs:
    `data=dict(arithmetic=dict(max_operand=999))`), each value type-checked and a misspelt
    field failing by name. Fields whose value comes from a preset are typed placeholders (None =
    "from the preset"): every `ModelConfig` field (`model.preset`), the method preset's
    `loss.prune` / `loss.correction` / `loss.rejection`, and `loss.temperature` (defaults to
    `rollout.temperature`). So every field exists and can be overridden from the command line
    with its type checked (the ConfigDict is locked by `main.py`).
    """
    c = ml_collections.ConfigDict()
    c.method = method or "dvp"  # a losses.PRESETS name (docs/design.md section 2)
    from_preset = {"model": {f.name for f in dataclasses.fields(ModelConfig)}}
    from_preset["loss"] = {"prune", "correction", "rejection", "temperature"}
    for section, cls in _SECTIONS.items():
        c[section] = _fields_dict(cls, from_preset.get(section, ()))
    for name, cls in GENERATED_TASKS.items():  # each task's knobs under its own names
        c.data[name] = _fields_dict(cls, skip=("seed",))
    # A ModelConfig preset name, the fields above overriding it; "": "tiny", or with hf_path
    # the architecture of its config.json (a preset or field given too must agree with it).
    c.model.preset = ""
    # -1: the tokenizer's vocabulary rounded up to a multiple of 8 (with hf_path: the file's)
    c.model.vocab_size = -1
    # A Hugging Face Qwen3 model to start from: a local directory or a Hub repo id resolved
    # through the HF cache (HF_HUB_OFFLINE=1: the cache only); "" = random init.
    c.model.hf_path = ""
    for name in _TOP_LEVEL[1:]:
        c[name] = field_default(
            next(f for f in dataclasses.fields(ExperimentConfig) if f.name == name)
        )
    c.lock()  # a misspelt field in `sections` fails here, by name
    c.update(sections)
    c.unlock()
    return c


def _fields_dict(cls, from_preset=(), skip=()) -> ml_collections.ConfigDict:
    """Dataclass `cls`'s fields with their defaults; a None default (or one `from_preset`) is a
    placeholder of the field's type (`float | None` -> float)."""
    sub = ml_collections.ConfigDict()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = None if f.name in from_preset else field_default(f)
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
