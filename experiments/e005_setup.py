"""e005's setup, shared by its sample units (e005_mechanism) and gradient units (e005_gradients).

The e004 config at each rung, the fp32 trainer policy (the warm start or a random init), the
rollout engine, the coupled draws and the trainer's statistics. It runs nothing by itself and
imports neither runner, so the imports run one way (mechanism -> gradients -> setup); e006
builds its arms from the same functions.
"""

from __future__ import annotations

import dataclasses
import os

from experiments import e005_verdict as rules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/e004_running_sum.py"
SEED = 5  # the sampler key of every rung (coupled draws)
PROMPTS_PER_CHUNK, SAMPLES = 64, 16
LOG_RHO = -13.0
# Rung -> (the e004 config's level, overrides); plain bf16 is M0's config at a bf16 rollout.
RUNGS = {"M0": ("M0", {})} | {
    r: ("M0", {"rollout.dtype": "bfloat16"}) if r == "bf16" else (r, {}) for r in rules.RUNGS
}
SMOKE = {  # CI sizes on a random init
    "model.d_model": 32,
    "model.head_dim": 8,
    "model.d_ff": 64,
    "data.running_sum.min_response_len": 14,
    "data.running_sum.max_response_len": 16,
    "rollout.max_decode_length": 17,
}


# ------------------------------------------------------------------------------------------------
# Setup: config, policy, engine.
# ------------------------------------------------------------------------------------------------
def rung_config(rung: str, smoke: bool = False):
    """The validated `ExperimentConfig` of the e004 config at `rung`."""
    from dvp_jax.pyfile import load_file
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    level, overrides = RUNGS[rung]
    cd = load_file(os.path.join(REPO, CONFIG)).get_config(f"rloo:{level}")
    cd.lock()
    cd.update_from_flattened_dict({**overrides, **(SMOKE if smoke else {})})
    return ExperimentConfig.from_config_dict(cd, load_tokenizer(cd.data.tokenizer).vocab_size)


def policy(cfg, init_hf: str | None):
    """The fp32 trainer model: the warm start, or a random init (smoke) exported nowhere."""
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, Transformer
    from dvp_jax.model.hf_import import load_hf

    if init_hf:
        return load_hf(init_hf, TRAIN_POLICY, cfg=cfg.model)
    return Transformer(cfg.model, TRAIN_POLICY, rngs=nnx.Rngs(0))


def engine_for(cfg, model, log_rho: float, slots: int = 64):
    """The rollout engine at the config's rung (weights quantized by the engine itself)."""
    from flax import nnx

    from dvp_jax.rollout.engine import RolloutEngine
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.build import engine_config

    ec = dataclasses.replace(
        engine_config(cfg),
        max_concurrent_decodes=slots,
        prefill_buckets=(cfg.data.max_prompt_len,),
        log_rho=log_rho,
        seed=0,
    )
    tok = load_tokenizer(cfg.data.tokenizer)
    return RolloutEngine(cfg.model, ec, tokenizer=tok, params=nnx.state(model, nnx.Param))


def chunk_examples(cfg, chunk: int, prompts: int = PROMPTS_PER_CHUNK):
    """The train examples of chunk `chunk` (the same at every rung) and its first prompt index."""
    first = chunk * prompts
    return cfg.data.make_task().train_examples(prompts, start=first), first


def sample(cfg, model, examples, first: int, log_rho: float, samples: int = SAMPLES):
    """Coupled draws: prompt p's key is fold_in(key(SEED), first + p) at every rung."""
    import jax

    from dvp_jax.rollout.offline import generate_rollouts

    engine = engine_for(cfg, model, log_rho, slots=min(64, len(examples) * samples))
    prompts, key, width = (
        [ex.prompt for ex in examples],
        jax.random.key(SEED),
        cfg.data.max_prompt_len,
    )
    rows = generate_rollouts(
        engine, prompts, samples, key, prompt_len=width, first_prompt_index=first
    )
    return engine, rows


def trainer_stats(cfg, model, rl, rows: int = 16) -> dict:
    """The fp32 trainer's statistics at log rho = -13 (e004's), [N, T-1] arrays."""
    from experiments.e004_measure import trainer_token_stats

    return trainer_token_stats(cfg, model, rl, rows)
