"""Train-step throughput of the jitted DVP-RLOO step on this machine's CPU.

Prints one JSON line: for the tiny and a ~50M-parameter config, tokens/s of `rl_update`
(forward + chunked pruned logprobs + loss + backward + AdamW), CPU MFU against a measured
`jnp.dot` peak, and the time ratio when the tokens per step double (expect <= 2.2x).

  python benchmarks/train_step.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dvp_jax.dvp.losses import LossConfig
from dvp_jax.model import ModelConfig, Transformer
from dvp_jax.sharding import Sharder, count_params
from dvp_jax.train import step as step_lib
from dvp_jax.train.state import init_train_state, make_optimizer

# The random batch builder is shared with the tests (test data stays out of the library).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.train_utils import synthetic_batch  # noqa: E402

CONFIGS = {
    "tiny": ModelConfig(
        vocab_size=64,
        d_model=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        d_ff=256,
        tie_embeddings=True,
    ),
    "50m": ModelConfig(
        vocab_size=8192,
        d_model=512,
        n_layers=12,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        d_ff=2048,
        tie_embeddings=True,
    ),
}


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Measured fp32 FLOP/s of one jitted n x n x n `jnp.dot` (the MFU denominator)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    return 2 * n**3 / _median_time(lambda: dot(a, b), repeats)


def train_flops_per_token(cfg: ModelConfig, n_params: int, length: int) -> float:
    """6 N (matmul params, fwd + bwd) + causal attention 6 * L * T * n_heads * head_dim."""
    attn = 6 * cfg.n_layers * length * cfg.n_heads * cfg.head_dim  # QK^T and PV, /2 causal, x3
    return 6 * n_params + attn


def measure(name: str, rows: int, length: int, repeats: int, peak: float) -> dict:
    cfg = CONFIGS[name]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    n_params = count_params(nnx.state(model))
    optimizer = make_optimizer(1e-4, 0, 0.0, 1.0)
    graphdef, state, _ = init_train_state(model, optimizer, 0, Sharder())
    fn = jax.jit(
        lambda s, b: step_lib.rl_update(
            s,
            b,
            graphdef=graphdef,
            optimizer=optimizer,
            loss_cfg=LossConfig.preset("mis_dvp"),
            chunk_size=min(8192, cfg.vocab_size),
            micro_batches=1,
        ),
        donate_argnums=0,
    )
    holder = {"state": state}

    def run(batch):
        holder["state"], metrics = fn(holder["state"], batch)
        return metrics["loss"]

    out = {}
    for scale in (1, 2):
        batch = jax.tree.map(
            jnp.asarray, synthetic_batch(cfg.vocab_size, rows * scale, length, length // 4)
        )
        jax.block_until_ready(run(batch))  # compile + warm up
        out[scale] = _median_time(functools.partial(run, batch), repeats)
    tokens = rows * length
    flops = train_flops_per_token(cfg, n_params, length) * tokens
    return {
        f"{name}_params": n_params,
        f"{name}_tokens_per_step": tokens,
        f"{name}_step_s": out[1],
        f"{name}_tok_s": tokens / out[1],
        f"{name}_mfu": flops / out[1] / peak,
        f"{name}_2x_tokens_time_ratio": out[2] / out[1],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller batches")
    args = parser.parse_args()
    repeats = 3 if args.quick else 5
    peak = matmul_peak_flops(1024 if args.quick else 2048, repeats)
    result = {
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "matmul_peak_gflops": peak / 1e9,
    }
    result.update(
        measure("tiny", rows=64 if not args.quick else 16, length=32, repeats=repeats, peak=peak)
    )
    result.update(
        measure("50m", rows=8 if not args.quick else 2, length=128, repeats=repeats, peak=peak)
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
