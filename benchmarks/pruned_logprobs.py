"""Chunked pruned token log-probabilities vs the naive full-logits version, forward + backward.

Times `jax.grad` of sum_n c_n log pi_S(y_n) (E2) with respect to h [N, d] and W [d, V] both
ways on the same inputs: naive (full [N, V] float32 logits, the E1 mask, masked log_softmax)
and `dvp.chunked.chunked_pruned_logprobs` (vocabulary chunks, custom VJP), at `--precision`.
One JSON line: naive_s, chunked_s (medians of interleaved runs after a warm-up), time_ratio,
naive_bytes / chunked_bytes (compiled temp bytes), mem_ratio, max_grad_rel_err. Targets on
GPU: time_ratio <= 1.35 (4 matmuls against 3), mem_ratio <= 0.05.

    python benchmarks/pruned_logprobs.py                   # N=2048, d=512, V=151936
    python benchmarks/pruned_logprobs.py --quick           # N=256, d=128, V=32000, 3 runs
    python benchmarks/pruned_logprobs.py --chunk-sizes 4096,8192,16384   # pick the fastest
    python benchmarks/pruned_logprobs.py --precision highest   # true fp32 matmuls on GPU/TPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dvp_jax.cli import BACKENDS, require_backend
from dvp_jax.dvp import pruning
from dvp_jax.dvp.chunked import DEFAULT_CHUNK_SIZE, chunked_pruned_logprobs


def naive_logprobs(h, w, y, log_rho, temperature, precision=None):
    """log pi_S(y) `[N]` through the full `[N, V]` float32 logits (the baseline)."""
    # [N, d] x [d, V] -> [N, V]
    logits = jnp.einsum("nd,dv->nv", h, w, preferred_element_type=jnp.float32, precision=precision)
    logits = logits / temperature
    mask = logits >= jnp.max(logits, axis=-1, keepdims=True) + log_rho  # E1
    logp = jax.nn.log_softmax(logits, axis=-1, where=mask)  # E2 on V_S
    logp = jnp.where(mask, logp, pruning.LOGP_FLOOR)
    return jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]


def compile_grad(logprobs_fn, args):
    """AOT-compiled grad of sum(c * logp) w.r.t. (h, W); the caller times `compiled(*args)`."""

    def loss(h, w, y, c):
        return jnp.sum(c * logprobs_fn(h, w, y))

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()


def time_runs(fns, args, runs):
    """One warm-up each, then `runs` interleaved timed calls; returns per-fn median seconds."""
    for f in fns:
        jax.block_until_ready(f(*args))
    times = [[] for _ in fns]
    for _ in range(runs):
        for i, f in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--log-rho", type=float, default=-13.0)
    parser.add_argument(
        "--chunk-sizes",
        default=str(DEFAULT_CHUNK_SIZE),
        help="comma-separated; with several, each is timed and the fastest kept",
    )
    parser.add_argument("--runs", type=int, default=None, help="timed runs (default 5, 3 quick)")
    parser.add_argument(
        "--precision",
        default=None,
        choices=[p.name.lower() for p in jax.lax.Precision],
        help="matmul precision of both versions (default: the backend's)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="N=256, d=128, V=32000, 3 runs unless --runs"
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help="refuse to run on another backend"
    )
    args = parser.parse_args()
    require_backend(args.backend)
    if args.quick:
        args.n, args.d, args.v = 256, 128, 32000
    if args.runs is None:
        args.runs = 3 if args.quick else 5

    rng = np.random.default_rng(0)
    # Logit scale ~ 3: a realistic spread, so the e^-13 safe set is a strict subset of V.
    h = jnp.asarray(rng.normal(size=(args.n, args.d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(args.d, args.v)) * 3.0 / np.sqrt(args.d), jnp.float32)
    y = jnp.asarray(rng.integers(0, args.v, size=args.n), jnp.int32)
    c = jnp.asarray(rng.normal(size=args.n), jnp.float32)
    inputs = (h, w, y, c)

    precision = None if args.precision is None else jax.lax.Precision(args.precision)
    naive = compile_grad(
        lambda h, w, y: naive_logprobs(h, w, y, args.log_rho, 1.0, precision), inputs
    )
    chunked = {}
    for chunk_size in (int(s) for s in args.chunk_sizes.split(",")):
        fn = lambda h, w, y, cs=chunk_size: (
            chunked_pruned_logprobs(
                h, w, y, log_rho=args.log_rho, chunk_size=cs, precision=precision
            ).logp
        )
        chunked[chunk_size] = compile_grad(fn, inputs)

    sweep = {}
    if len(chunked) > 1:  # short sweep (2 runs each) to pick the chunk size
        secs = time_runs(list(chunked.values()), inputs, runs=2)
        sweep = dict(zip(chunked, secs, strict=True))
    best = min(sweep, key=sweep.get) if sweep else next(iter(chunked))

    naive_s, chunked_s = time_runs([naive, chunked[best]], inputs, args.runs)
    g_naive, g_chunked = naive(*inputs), chunked[best](*inputs)
    err = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
        for a, b in zip(g_naive, g_chunked, strict=True)
    )
    naive_bytes = naive.memory_analysis().temp_size_in_bytes
    chunked_bytes = chunked[best].memory_analysis().temp_size_in_bytes
    print(
        json.dumps(
            {
                "n": args.n,
                "d": args.d,
                "v": args.v,
                "log_rho": args.log_rho,
                "chunk_size": best,
                "runs": args.runs,
                "precision": args.precision or "default",
                "naive_s": round(naive_s, 4),
                "chunked_s": round(chunked_s, 4),
                "time_ratio": round(chunked_s / naive_s, 3),
                "naive_bytes": naive_bytes,
                "chunked_bytes": chunked_bytes,
                "mem_ratio": round(chunked_bytes / naive_bytes, 4),
                "max_grad_rel_err": err,
                "sweep_s": {str(k): round(v, 4) for k, v in sweep.items()},
                "backend": jax.default_backend(),
                "devices": jax.device_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
