"""What top-k / top-p truncation (E13) costs at the paper's vocabulary, on both sides.

Sampler: `rollout.sampling.sample` on `[B, V]` logits with kept width W against the same call
without truncation (W = 0). Trainer: forward + backward of `chunked_pruned_logprobs` on `[N, d]`
hidden states and a `[d, V]` unembedding with `[N, W]` kept ids against the same without. One
JSON line: sampler_s, sampler_truncated_s, sampler_ratio, trainer_s, trainer_truncated_s,
trainer_ratio (medians of interleaved runs after a warm-up, measured on this machine's
backend), and kept_ids_bytes_per_token (W int32 plus the truncated mass).

    python benchmarks/truncation.py                  # B=16, N=256, d=512, V=151936, W=64
    python benchmarks/truncation.py --quick          # V=32000, 3 runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dvp_jax.dvp.chunked import chunked_pruned_logprobs
from dvp_jax.rollout import sampling


def _median_times(fns, runs):
    for fn in fns:  # warm-up (compile)
        jax.block_until_ready(fn())
    times = [[] for _ in fns]
    for _ in range(runs):
        for t, fn in zip(times, fns, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", type=int, default=16, help="decode rows B")
    parser.add_argument("--tokens", type=int, default=256, help="trainer tokens N")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--width", type=int, default=64, help="kept width W (max_kept)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.runs = 32_000, 3
    rng = np.random.default_rng(0)
    v, w_ = args.vocab, args.width

    logits = jnp.asarray(3.0 * rng.standard_normal((args.rows, v)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), args.rows)
    plain = sampling.SamplingParams.create()
    top_p = sampling.SamplingParams.create(top_p=0.95)
    sample = jax.jit(sampling.sample, static_argnames="kept_width")
    sampler = _median_times(
        [
            lambda: sample(keys, logits, plain, kept_width=0),
            lambda: sample(keys, logits, top_p, kept_width=w_),
        ],
        args.runs,
    )

    n, d = args.tokens, args.d_model
    h = jnp.asarray(rng.standard_normal((n, d)) / np.sqrt(d), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    kept = jnp.asarray(
        np.concatenate([y[:, None], rng.integers(0, v, (n, w_ - 1))], axis=1), jnp.int32
    )

    def grad_fn(kept_ids):
        def loss(h, w):
            out = chunked_pruned_logprobs(h, w, y, log_rho=-13.0, kept_ids=kept_ids)
            return jnp.sum(jnp.where(out.in_safe, out.logp, 0.0))

        return jax.jit(jax.grad(loss, (0, 1)))

    plain_grad, kept_grad = grad_fn(None), grad_fn(kept)
    trainer = _median_times([lambda: plain_grad(h, w), lambda: kept_grad(h, w)], args.runs)
    print(
        json.dumps(
            dict(
                backend=jax.default_backend(),
                vocab=v,
                width=w_,
                sampler_s=sampler[0],
                sampler_truncated_s=sampler[1],
                sampler_ratio=sampler[1] / sampler[0],
                trainer_s=trainer[0],
                trainer_truncated_s=trainer[1],
                trainer_ratio=trainer[1] / trainer[0],
                kept_ids_bytes_per_token=4 * w_ + 4,
            )
        )
    )


if __name__ == "__main__":
    main()
