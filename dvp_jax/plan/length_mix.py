"""Response lengths for cost estimates: a mean turned into a long-tailed mix, or a file of them.

`python -m dvp_jax.aot --response_length_mean M` (or `--response_lengths FILE`) prices a step at
real lengths: the packed update (`train/cost.py`) and the rollout at live length both take the
lengths of one step's responses from here, so the two estimates see the same batch.

A mean becomes N lengths from a lognormal of shape `LOGNORMAL_SIGMA`, clipped to
[1, max_len], its scale solved so the clipped mean is M (a mean at or above max_len gives every
response max_len): DAPO-style math RL has most responses short and a few at the cap. The
lengths are the distribution's quantiles at (i + 1/2) / N, so they carry no sampling noise,
then put in a fixed pseudo-random order (what a rollout sees: long and short responses mixed).
"""

from __future__ import annotations

import math

import numpy as np

# Shape of the lognormal behind a mean (log-space standard deviation): a median of about
# 0.6 x the mean and a p95 of about 3 x the median, before clipping at the cap.
LOGNORMAL_SIGMA = 1.0


def lengths_from_mean(mean: float, n: int, max_len: int, sigma: float = LOGNORMAL_SIGMA):
    """`n` int lengths in [1, max_len] whose mean is `mean` (module docstring).

    Raises:
      ValueError: `mean` not in [1, inf), or `n` / `max_len` < 1.
    """
    if not (isinstance(mean, int | float) and math.isfinite(mean) and mean >= 1):
        raise ValueError(f"a response length mean must be a number >= 1, got {mean!r}")
    if n < 1 or max_len < 1:
        raise ValueError(f"need n >= 1 and max_len >= 1, got n={n}, max_len={max_len}")
    if mean >= max_len:
        return np.full((n,), max_len, np.int64)
    from scipy.special import ndtri  # the normal quantile function

    z = ndtri((np.arange(n) + 0.5) / n)

    def clipped(mu: float) -> np.ndarray:
        return np.clip(np.rint(np.exp(mu + sigma * z)), 1, max_len).astype(np.int64)

    lo, hi = -10.0, math.log(max_len) + 10 * sigma  # clipped mean 1 ... max_len
    for _ in range(200):  # bisection on the log-scale; the clipped mean rises with mu
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if clipped(mid).mean() < mean else (lo, mid)
    lengths = clipped(hi)
    return lengths[np.random.default_rng(0).permutation(n)]


def lengths_from_file(path: str, n: int, max_len: int):
    """`n` lengths from a text file of integers (whitespace-separated, `#` starts a comment),
    taken in order and repeated from the start when the file holds fewer than `n`.

    Raises:
      ValueError: one line naming the file and what is wrong (unreadable, empty, a value that
        is not an int in [1, max_len]).
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--response_lengths {path}: {e.strerror or e}") from None
    values = []
    for line_no, line in enumerate(text.splitlines(), 1):
        for word in line.split("#")[0].split():
            try:
                value = int(word)
            except ValueError:
                value = None
            if value is None or not 1 <= value <= max_len:
                raise ValueError(
                    f"--response_lengths {path}: line {line_no} has {word!r}; each length must "
                    f"be an int in [1, {max_len}] (rollout.max_decode_length)"
                )
            values.append(value)
    if not values:
        raise ValueError(f"--response_lengths {path}: no lengths in the file")
    return np.resize(np.asarray(values, np.int64), n)


def response_lengths(n: int, max_len: int, *, mean: float | None = None, path: str = ""):
    """One step's `n` response lengths from `mean` or `path` (exactly one of them)."""
    if (mean is None) == (not path):
        raise ValueError("give one of --response_length_mean and --response_lengths")
    if path:
        return lengths_from_file(path, n, max_len)
    return lengths_from_mean(mean, n, max_len)
