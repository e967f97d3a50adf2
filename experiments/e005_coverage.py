"""e005's gradient-bias intervals under a known truth: how often each covers a zero bias.

Simulates the coupled design of e005's D at its recorded scales: n groups, K sketch coordinates,
a reference gradient estimate per group ref_i = mu + e_i and a method's x_i = ref_i + f_i, with
||mu||^2 = 1, tr Cov(e) / n = REF_NOISE and tr Cov(f) / n = DIFF_NOISE (the recorded ratios at
T = 96-192: the reference's noise term ~24x its squared norm, the difference's ~50x), a
power-law covariance spectrum (eigenvalue k ~ 1/k, a gradient-like spread; `--spectrum flat`:
isotropic) and a true bias b (f's mean), ||b||^2 = BIAS_SQ. For each draw it forms
  * `first`: e005's first interval, percentiles of the resampled relative bias (each resample's
    corrected squared norms, so they centre on the plain estimates; e005_gradients before issue 37),
  * `centred`: `e005_gradients.bias_sq_interval` on x - ref (the corrected interval),
and reports the share of draws whose interval contains 0 and whose lower end is above 0 (the
claim-3 gate firing: a false positive at zero bias, the test's power otherwise).
Command (repository root; ~1 minute on one core):
  python -m experiments.e005_coverage [--reps 400] [--dist gaussian|t3] [--spectrum power|flat]
      [--bias_sq 0,4,16,64]
Figures (400 draws each): experiments/README.md, e005 corrected.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from experiments.e005_gradients import BOOTSTRAP, bias_sq_interval

GROUPS, DIM = 128, 1024  # e005's D: 128 coupled groups, a 1,024-coordinate sketch
REF_NOISE, DIFF_NOISE = 24.0, 50.0  # tr Cov / n over ||E ref||^2 (grad_M3.json, T = 96-192)


def _noise(rng, n: int, scale: np.ndarray, dist: str) -> np.ndarray:
    z = rng.standard_normal((n, len(scale)))
    if dist == "t3":  # heavy tails per group (a few outlying groups), unit variance
        z *= np.sqrt(1.0 / 3.0) * np.sqrt(3.0 / rng.chisquare(3, (n, 1)))
    return z * scale


def first_interval(x, ref, boot: int, rng) -> tuple[float, float]:
    """e005's first interval: percentiles of sqrt(U*(x - ref) / U*(ref)) over resamples."""
    n = x.shape[0]
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=boot).astype(np.float64)

    def u(d):
        s = w @ d
        return ((s * s).sum(1) - w @ (d * d).sum(1)) / (n * (n - 1))

    b2, r2 = u(x - ref), u(ref)
    rel = np.where(r2 > 0, np.sqrt(np.maximum(b2, 0) / np.where(r2 > 0, r2, 1)), np.nan)
    lo, hi = np.nanpercentile(rel, [2.5, 97.5])
    return float(lo), float(hi)


def simulate(
    reps: int = 200, groups: int = GROUPS, dim: int = DIM, bias_sq: float = 0.0,
    dist: str = "gaussian", boot: int = BOOTSTRAP, seed: int = 0, spectrum: str = "power",
) -> dict:  # fmt: skip
    """Share of `reps` draws whose first / centred interval contains 0 (at bias_sq = 0)."""
    rng = np.random.default_rng(seed)
    spec = 1.0 / np.arange(1, dim + 1) if spectrum == "power" else np.ones(dim)
    unit = lambda v: v / np.linalg.norm(v)
    mu = unit(rng.standard_normal(dim))
    bias = unit(rng.standard_normal(dim)) * np.sqrt(bias_sq)
    s_ref = np.sqrt(spec / spec.sum() * REF_NOISE * groups)  # tr Cov(e) = REF_NOISE * n
    s_diff = np.sqrt(spec[rng.permutation(dim)] / spec.sum() * DIFF_NOISE * groups)
    first = centred = excl_above = 0
    for _ in range(reps):
        ref = mu + _noise(rng, groups, s_ref, dist)
        x = ref + bias + _noise(rng, groups, s_diff, dist)
        lo, _ = first_interval(x, ref, boot, rng)
        first += lo <= 0.0
        _, lo_c, hi_c = bias_sq_interval(x - ref, boot=boot, seed=int(rng.integers(1 << 31)))
        centred += lo_c <= 0.0 <= hi_c
        excl_above += lo_c > 0.0
    return {
        "reps": reps, "groups": groups, "dim": dim, "bias_sq": bias_sq, "dist": dist,
        "spectrum": spectrum, "first_contains_0": first / reps,
        "centred_contains_0": centred / reps, "centred_lower_above_0": excl_above / reps,
    }  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--dist", default="gaussian", choices=("gaussian", "t3"))
    p.add_argument("--spectrum", default="power", choices=("power", "flat"))
    p.add_argument("--bias_sq", default="0,4,16,64", help="||b||^2 / ||E ref||^2 values")
    args = p.parse_args(argv)
    for b in (float(v) for v in args.bias_sq.split(",")):
        print(
            json.dumps(simulate(args.reps, bias_sq=b, dist=args.dist, spectrum=args.spectrum)),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
