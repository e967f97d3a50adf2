"""Error of the trainer's fp32-class matmul algorithms, emulated on any backend.

  python benchmarks/matmul_precision.py            # Qwen3-14B unembedding shapes, 256 rows
  python benchmarks/matmul_precision.py --quick    # smaller

A TPU multiplies float32 matrices from bfloat16 pieces (x = hi + mid + lo) with float32
accumulation: DEFAULT is one product (hi.hi; `mixed_bf16`), BF16_BF16_F32_X3 three
(`float32_x3`), HIGHEST six (`float32`). This script computes each from explicit bf16 pieces,
so a CPU runs the same arithmetic, for the logits h W at d = 5120 (Qwen3-14B's largest
contraction), and reports against float64 the largest logit error over the largest |logit| and
the mean and largest log-softmax error. 3xTF32 (`float32_x3` on NVIDIA) is not emulated.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np


def pieces(x: jax.Array, n: int) -> list[jax.Array]:
    """x = sum of n bfloat16 pieces (each the bf16 rounding of what the earlier ones left)."""
    out, rest = [], x
    for _ in range(n):
        piece = rest.astype(jnp.bfloat16)
        out.append(piece)
        rest = rest - piece.astype(jnp.float32)
    return out


def emulated_dot(a: jax.Array, b: jax.Array, passes: int) -> jax.Array:
    """a @ b by the TPU's bf16 algorithm of `passes` products (1, 3 or 6)."""
    dot = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
    if passes == 1:
        return dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    if passes == 3:
        (ah, al), (bh, bl) = pieces(a, 2), pieces(b, 2)
        return dot(al, bh) + dot(ah, bl) + dot(ah, bh)
    if passes == 6:
        (ah, am, al), (bh, bm, bl) = pieces(a, 3), pieces(b, 3)
        small = dot(al, bh) + dot(ah, bl) + dot(am, bm)
        return small + dot(am, bh) + dot(ah, bm) + dot(ah, bh)
    raise ValueError(f"passes must be 1, 3 or 6, got {passes}")


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--d", type=int, default=5120)
    parser.add_argument("--v", type=int, default=32768)
    parser.add_argument("--quick", action="store_true", help="64 rows, d 1024, V 8192")
    args = parser.parse_args(argv)
    rows, d, v = (64, 1024, 8192) if args.quick else (args.rows, args.d, args.v)
    rng = np.random.default_rng(0)
    # RMS-normalised hidden states and an init-scale unembedding: logits of O(1).
    h = rng.normal(size=(rows, d)).astype(np.float32)
    w = (rng.normal(size=(d, v)) * d**-0.5 * 4).astype(np.float32)
    ref = h.astype(np.float64) @ w.astype(np.float64)
    ref_lsm = log_softmax(ref)
    result = {"rows": rows, "d": d, "v": v, "backend": jax.default_backend()}
    for name, passes in (("bf16_1pass", 1), ("bf16_3pass", 3), ("bf16_6pass", 6)):
        out = np.asarray(jax.jit(emulated_dot, static_argnums=2)(h, w, passes), np.float64)
        err = np.abs(log_softmax(out) - ref_lsm)
        result[f"{name}_logit_rel_err"] = float(np.abs(out - ref).max() / np.abs(ref).max())
        result[f"{name}_logsoftmax_mean_abs_err"] = float(err.mean())
        result[f"{name}_logsoftmax_max_abs_err"] = float(err.max())
    exact = np.asarray(jnp.dot(h, w, precision="highest"), np.float64)
    result["float32_logit_rel_err"] = float(np.abs(exact - ref).max() / np.abs(ref).max())
    print(json.dumps({k: round(x, 10) if isinstance(x, float) else x for k, x in result.items()}))


if __name__ == "__main__":
    main()
