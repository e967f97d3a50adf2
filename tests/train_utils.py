"""Shared builders for trainer tests: the tiny CPU config shrunk to test size."""

from __future__ import annotations

import os

from dvp_jax.pyfile import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = os.path.join(REPO, "configs", "tiny_cpu.py")

# Overrides that make a run take seconds: 1 layer, 4 prompts x 2 samples, 4 new tokens.
TEST_OVERRIDES = {
    "model.d_model": 32,
    "model.n_layers": 1,
    "model.head_dim": 8,
    "model.d_ff": 64,
    "train.steps": 3,
    "train.prompts_per_step": 4,
    "train.group_size": 2,
    "rollout.max_new_tokens": 4,
    "rollout.num_slots": 8,
    "sft.steps": 2,
    "sft.batch_size": 8,
    "eval.num_prompts": 8,
    "eval.k": 2,
    "eval.every": 2,
    "checkpoint.every": 2,
    "plots": False,
}


def tiny_config_dict(**overrides):
    c = load_file(TINY_CONFIG).get_config()
    for dotted, value in {**TEST_OVERRIDES, **overrides}.items():
        node = c
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def cli_overrides(**overrides) -> list[str]:
    return [f"--config.{k}={v}" for k, v in {**TEST_OVERRIDES, **overrides}.items()]
