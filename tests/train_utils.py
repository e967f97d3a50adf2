"""Shared builders for trainer tests: the tiny CPU config shrunk to test size, a random batch."""

from __future__ import annotations

import os

import numpy as np

from dvp_jax.pyfile import load_file
from dvp_jax.train.batch import RLBatch
from tests import child_env

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
    "rollout.max_decode_length": 4,
    "rollout.max_concurrent_decodes": 8,
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
    c.lock()  # as main.py's config flag: a misspelt override fails
    for dotted, value in {**TEST_OVERRIDES, **overrides}.items():
        node = c
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def cli_overrides(**overrides) -> list[str]:
    return [f"--config.{k}={v}" for k, v in {**TEST_OVERRIDES, **overrides}.items()]


def synthetic_batch(
    vocab_size: int, rows: int, length: int, prompt_len: int, seed: int = 0
) -> RLBatch:
    """A random host RLBatch (numpy) of fixed shapes, for tests and benchmarks.

    Every row has `prompt_len` prompt tokens then response tokens to the end; behaviour
    logprobs are uniform in [-4, -0.5] on response positions; advantages are standard normal.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, (rows, length)).astype(np.int32)
    response = np.zeros((rows, length - 1), bool)
    response[:, prompt_len - 1 :] = True
    logp = np.where(response, -rng.uniform(0.5, 4.0, (rows, length - 1)), 0).astype(np.float32)
    return RLBatch(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
        segment_ids=np.ones((rows, length), np.int32),
        response_mask=response,
        behaviour_logp=logp,
        behaviour_logp_full=logp.copy(),
        behaviour_pruned_mass=np.zeros_like(logp),
        behaviour_safe_size=np.full_like(logp, float(vocab_size)),
        advantages=rng.normal(size=rows).astype(np.float32),
        old_logp=np.zeros_like(logp),
        old_in_safe=np.ones(logp.shape, bool),
    )


def synthetic_rollouts(vocab_size: int, prompt_lengths, response_lengths, seed: int = 0):
    """A random host `RolloutBatch` with the given prompt and response lengths (N rows, T =
    max prompt + max response columns), laid out as `offline.generate_rollouts` lays it out:
    the prompt from column 0, its response after it, zeros beyond. Behaviour log-probs are
    uniform in [-4, -0.2] (the unpruned ones up to 0.3 lower), pruned masses in [0, 1e-3),
    safe-set sizes in [1, vocab]; about one response in four is cut (not finished)."""
    from dvp_jax.rollout.offline import RolloutBatch

    rng = np.random.default_rng(seed)
    lp, lr = np.asarray(prompt_lengths, np.int32), np.asarray(response_lengths, np.int32)
    n, t = lp.size, int(lp.max() + lr.max())
    cols = np.arange(t)[None, :]
    prompt_mask = cols < lp[:, None]
    response_mask = ~prompt_mask & (cols < (lp + lr)[:, None])
    tokens = np.where(prompt_mask | response_mask, rng.integers(3, vocab_size, (n, t)), 0)
    on = lambda x: np.where(response_mask, x, 0).astype(np.float32)
    logp = on(-rng.uniform(0.2, 4.0, (n, t)))
    return RolloutBatch(
        tokens=tokens.astype(np.int32),
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        behaviour_logp=logp,
        behaviour_logp_full=on(logp - rng.uniform(0.0, 0.3, (n, t))),
        behaviour_pruned_mass=on(rng.uniform(0.0, 1e-3, (n, t))),
        behaviour_safe_size=np.where(response_mask, rng.integers(1, vocab_size, (n, t)), 0).astype(
            np.int32
        ),
        prompt_index=np.arange(n, dtype=np.int32),
        group_index=np.zeros(n, np.int32),
        prompt_lengths=lp,
        response_lengths=lr,
        finished=rng.uniform(size=n) > 0.25,
    )


# The processes tests start see this session's devices and matmul precision (tests/conftest.py),
# so their tiny runs are the programs the session compiled once (one compilation cache): a run in a
# process and the same run in the test process are the same programs on the same inputs.
SESSION_DEVICES = 8


def main_command(
    workdir, *extra, devices: int | None = SESSION_DEVICES, **overrides
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of `python -m dvp_jax.main` on the test-size tiny config.

    `devices`: fake CPU devices of the process (None: set none, for `--cpu_devices`).
    """
    import sys

    cmd = [
        sys.executable,
        "-m",
        "dvp_jax.main",
        f"--config={TINY_CONFIG}",
        f"--workdir={workdir}",
        *cli_overrides(**overrides),
        *extra,
    ]
    return cmd, child_env(devices, JAX_DEFAULT_MATMUL_PRECISION="highest")
