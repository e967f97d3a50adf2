"""Served weights: a checkpoint read straight into the rollout dtype and layout, and its config.

The server's (`serve.server.build_engine`) loaders for its checkpoint flags, which
`dvp_jax.evaluate` shares; error messages name those flags. Hugging Face directories load
through `model.hf_import`; here are the Orbax and trainer-workdir paths and where each finds
the architecture. Nothing is cast after reading:
Orbax casts while it restores into the rollout targets.
"""

from __future__ import annotations

import json

import jax
from flax import nnx

from dvp_jax.errors import UserError
from dvp_jax.model.config import DTypePolicy, ModelConfig
from dvp_jax.model.transformer import Transformer
from dvp_jax.run_params import restore_params
from dvp_jax.sharding import Sharder, state_shardings
from dvp_jax.workdir import as_path


def _rollout_target(cfg: ModelConfig, policy: DTypePolicy, sharder: Sharder):
    """(graphdef, params as `ShapeDtypeStruct`s in the rollout dtype and shardings)."""
    make = lambda: Transformer(cfg, policy, sharder, rngs=nnx.Rngs(0))
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(abstract, sharder)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return graphdef, target


def load_orbax_params(path: str, cfg: ModelConfig, policy: DTypePolicy, sharder: Sharder):
    """Restores a StandardCheckpointer save of `nnx.state(Transformer(cfg, ...))`."""
    import orbax.checkpoint as ocp  # Local import: only this path needs orbax.

    _, target = _rollout_target(cfg, policy, sharder)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(as_path(path), target)


def load_trainer_params(path: str, cfg: ModelConfig, policy: DTypePolicy, sharder: Sharder):
    """The policy params of a trainer checkpoint (a `dvp_jax.main` workdir, its
    `checkpoints/` or one step's directory: the latest step)."""
    graphdef, target = _rollout_target(cfg, policy, sharder)
    return nnx.state(nnx.merge(graphdef, restore_params(path, nnx.to_pure_dict(target))))


def model_config(preset: str | None, config_file: str | None) -> ModelConfig:
    """The architecture of `--model_preset` or `--model_config` (an HF config.json)."""
    if preset and config_file:
        raise UserError("give one of --model_preset and --model_config")
    if preset:
        return ModelConfig.preset(preset)
    if config_file:
        with open(config_file) as f:
            return ModelConfig.from_hf(json.load(f))
    raise UserError("--orbax_checkpoint needs --model_preset or --model_config")


def trainer_model_config(path: str, preset: str | None, config_file: str | None) -> ModelConfig:
    """The flags' architecture if given, else the run's `model_config.json`."""
    root = as_path(path)
    if not root.exists():
        raise UserError(f"--trainer_checkpoint {path!r}: no such directory")
    if preset or config_file:
        return model_config(preset, config_file)
    for candidate in (root / "model_config.json", root.parent / "model_config.json"):
        if candidate.exists():
            return ModelConfig.from_hf(json.loads(candidate.read_text()))
    raise UserError(
        f"--trainer_checkpoint {path!r}: no model_config.json found there; pass --model_preset "
        "or --model_config"
    )


def hf_model_config(path: str) -> ModelConfig:
    """The config.json of a Hugging Face directory (not a trainer workdir's)."""
    from dvp_jax.model import hf_import

    root = as_path(path)
    if not (root / "config.json").exists():
        raise UserError(
            f"--hf_checkpoint {path!r}: no config.json there (a Hugging Face model "
            "directory has config.json and *.safetensors)"
        )
    if (root / "model_config.json").exists() and (root / "checkpoints").exists():
        raise UserError(
            f"--hf_checkpoint {path!r} is a dvp_jax.main workdir (its config.json is "
            "the experiment config): pass it as --trainer_checkpoint"
        )
    return hf_import.load_hf_config(path)
