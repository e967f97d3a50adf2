"""Response lengths for cost estimates: a mean turned into a long-tailed mix, or a file of them.

`python -m dvp_jax.aot --response_length_mean M` (or `--response_lengths FILE`) prices a step at
real lengths: the packed update (`update_cost.py`) and the rollout at live length
(`rollout_cost.py`) both take the lengths of one step's responses from here (`length_mixes`),
so the two estimates see the same batch.

A mean becomes N lengths from a lognormal of shape `LOGNORMAL_SIGMA`, clipped to
[1, max_len], its scale solved so the clipped mean is M (a mean at or above max_len gives every
response max_len): DAPO-style math RL has most responses short and a few at the cap. The
lengths are the distribution's quantiles at (i + 1/2) / N, so they carry no sampling noise,
then put in a fixed pseudo-random order (what a rollout sees: long and short responses mixed).
"""

from __future__ import annotations

import math
from typing import Any

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


def length_mixes(cfg, opts: dict[str, Any]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Each step the aot command's length flags describe, as (name, prompt lengths, response
    lengths), each [prompts_per_step * group_size]: one per mean of --response_length_mean (a
    comma-separated list), or the file of --response_lengths; [] when neither is given (no cost
    at real lengths is printed).

    Raises:
      ValueError: a mean that is not a number in [1, rollout.max_decode_length] (a mean above
        the cap cannot be the mean of capped lengths), a bad file, both flags, a bad prompt
        length.
    """
    means, path = opts["response_length_mean"] or [], opts["response_lengths"]
    if not means and not path:
        return []
    if means and path:
        raise ValueError("give one of --response_length_mean and --response_lengths")
    n = cfg.train.prompts_per_step * cfg.train.group_size
    prompt = opts["prompt_length"] or cfg.data.max_prompt_len
    if not 1 <= prompt <= cfg.data.max_prompt_len:
        raise ValueError(
            f"--prompt_length={prompt} must be in [1, data.max_prompt_len="
            f"{cfg.data.max_prompt_len}]"
        )
    prompts = np.full((n,), prompt, np.int64)
    cap = cfg.rollout.max_decode_length
    if path:
        return [(path, prompts, response_lengths(n, cap, path=path))]
    out = []
    for text in means:
        try:
            mean = float(text)
        except ValueError:
            raise ValueError(
                f"--response_length_mean: {text!r} is not a number (a mean, or a comma-separated "
                "list of means)"
            ) from None
        if mean > cap:
            raise ValueError(
                f"--response_length_mean={mean:g} is above rollout.max_decode_length={cap}, the "
                f"longest a response can be: give a mean in [1, {cap}] ({cap}: every response "
                "at the cap)"
            )
        name = f"mean {mean:g}, " + ("all at the cap" if mean == cap else "lognormal")
        out.append((name, prompts, response_lengths(n, cap, mean=mean)))
    return out
