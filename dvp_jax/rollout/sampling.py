"""Rollout sampling: temperature, optional logit noise, top-k / top-p, min-p pruning (E1, E4, E13).

One step for a batch of rows, a pure function of arrays (`decode.step` calls it), in this order:

  z  = (logits + sigma * s * n(c)) / tau   sigma = `noise_std` (default 0), c = the context,
                                           s = 1, or the tail ramp (`tail_ramp`)
  K  = top-k, then top-p of softmax(z)     (E13, `truncation`; off by default: K = everything)
  V_S = { a in K : z_a >= max_{b in K} z_b + log_rho }  (E1 on K; K holds the argmax, so this
                                           is E1 unchanged; log_rho = -inf keeps all of K)
  y  ~ mu_S = softmax(z restricted to V_S)  (E4, `inverse_cdf_draw`), or argmax z when greedy

Truncation before min-p (the order of Hugging Face's warpers; vLLM applies min-p first): K is a
function of the model's own tempered distribution, so the trainer can intersect it with its
own safe set (E13) and DVP's E1 is the same rule on both sides whatever K is.

and records the sampled token's `pruning.TokenLogprobs` (E2-E4) from `pruning.safe_set_sums`
and `pruning.token_logprobs`, the code the trainer's `pruning.pruned_token_logprobs` runs.
The noise n(c) ~ N(0, I) is a fixed function of the context (key `fold_in(NOISE_SEED key,
context_hash(c))`), so mu is a fixed distribution and what is recorded is exactly what is
sampled from (docs/design.md section 2; the tail-shaped form is a synthetic mismatch). With
`greedy` the recorded log-probs are still those of mu_S. Parameters are arrays, so changing
them never recompiles; everything here runs in float32.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from dvp_jax.dvp import pruning

# The noise of context c is drawn with fold_in(key(NOISE_SEED), context_hash(c)).
NOISE_SEED = 0x5EED
# FNV-1a over token ids (32 bit): h0 = offset basis, h <- (h xor id) * prime, wrapping.
_FNV_OFFSET, _FNV_PRIME = 2166136261, 16777619


def extend_context(h: jax.Array, tokens: jax.Array) -> jax.Array:
    """The context hash after appending `tokens` ([b] ids) to contexts hashed `h` ([b] uint32)."""
    return (h ^ tokens.astype(jnp.uint32)) * jnp.uint32(_FNV_PRIME)


def context_hash(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """[b] uint32 hash of each row's first `lengths[i]` ids of `tokens` ([b, T])."""
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]

    def step(h, column):
        ids, keep = column
        return jnp.where(keep, extend_context(h, ids), h), None

    h0 = jnp.full(tokens.shape[:1], _FNV_OFFSET, jnp.uint32)
    return jax.lax.scan(step, h0, (tokens.T, valid.T))[0]


@struct.dataclass
class SamplingParams:
    """Sampling settings as (traced) scalars.

    Attributes:
      temperature: tau > 0; logits are divided by it before anything else (ignored when greedy).
      log_rho: log of the min-p threshold rho (<= 0); -inf means no pruning.
      noise_std: sigma >= 0 of the additive Gaussian noise on the raw logits (0: off).
      greedy: take argmax z instead of sampling.
      noise_tail_gap: G >= 0; > 0 shapes the noise to the tail (synthetic, module docstring):
        token a's noise is scaled by clip((gap_a - G/2) / (G/2), 0, 1), gap_a its distance
        below the row max on the unperturbed tempered logits. 0 (the default): uniform noise.
        None behaves as 0.
      top_k: int32 k >= 0: keep the k highest tokens (E13); 0 (the default): off.
      top_p: float32 p in (0, 1]: keep the smallest set of the highest tokens (after top-k,
        renormalised over it) whose probability reaches p (E13); 1 (the default): off. Both
        act only in an engine compiled with a kept width (`sample(kept_width=)`); None: off.
    """

    temperature: jax.Array
    log_rho: jax.Array
    noise_std: jax.Array
    greedy: jax.Array
    noise_tail_gap: jax.Array | None = None
    top_k: jax.Array | None = None
    top_p: jax.Array | None = None

    @classmethod
    def create(
        cls,
        temperature: float = pruning.DEFAULT_TEMPERATURE,
        log_rho: float = pruning.DEFAULT_LOG_RHO,
        noise_std: float = 0.0,
        greedy: bool = False,
        noise_tail_gap: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> SamplingParams:
        """Validated constructor from Python values (see `check_sampling_values`)."""
        check_sampling_values(
            temperature, log_rho, noise_std, noise_tail_gap, top_k=top_k, top_p=top_p
        )
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            log_rho=jnp.asarray(log_rho, jnp.float32),
            noise_std=jnp.asarray(noise_std, jnp.float32),
            greedy=jnp.asarray(bool(greedy)),
            noise_tail_gap=jnp.asarray(noise_tail_gap, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
        )

    @property
    def truncates(self) -> bool:
        """Whether these (concrete) parameters ask for top-k or top-p (host-side check)."""
        k = 0 if self.top_k is None else int(self.top_k)
        p = 1.0 if self.top_p is None else float(self.top_p)
        return k > 0 or p < 1.0


def check_sampling_values(
    temperature: float | None,
    log_rho: float | None,
    noise_std: float | None,
    noise_tail_gap: float | None = 0.0,
    owner: str = "SamplingParams",
    *,
    top_k: int | None = 0,
    top_p: float | None = 1.0,
) -> None:
    """The one validation of each sampling setting; None: not set where `owner` holds them
    (a run's `rollout` section has no log_rho: the loss's is the rule).

    Raises ValueError naming the field (`owner.name`: where the value was given) and its
    allowed range.
    """
    if temperature is not None:
        pruning.check_temperature(temperature, f"{owner}.temperature")
    if log_rho is not None:
        pruning.check_log_rho(log_rho, f"{owner}.log_rho")
    for name, value, note in [
        ("noise_std", noise_std, ""),
        ("noise_tail_gap", noise_tail_gap, " (0: uniform noise)"),
    ]:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{owner}.{name} must be a finite number >= 0{note}, got {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}.{name} must be a finite number >= 0{note}, got {value}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)):
        raise ValueError(f"{owner}.top_k must be an int >= 0 (0: off), got {top_k!r}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"{owner}.top_k must be an int >= 0 (0: off), got {top_k}")
    if top_p is not None and (
        isinstance(top_p, bool)
        or not isinstance(top_p, numbers.Real)
        or not (0.0 < top_p <= 1.0)  # False for NaN
    ):
        raise ValueError(f"{owner}.top_p must be a number in (0, 1] (1: off), got {top_p!r}")


def tail_ramp(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """s_a = clip((gap_a - G/2) / (G/2), 0, 1) with gap_a = (max_b logits_b - logits_a) / tau.

    Args:
      logits: [b, v] float32 raw logits (before noise).
      params: sampling parameters; G = `noise_tail_gap` > 0, tau as in `scaled_logits`.
    Returns:
      [b, v] float32 in [0, 1]: exactly 0 within G/2 of the row max, 1 from G on.
    """
    tau = jnp.where(params.greedy, 1.0, params.temperature)
    gap = (jnp.max(logits, axis=-1, keepdims=True) - logits) / tau
    half = params.noise_tail_gap / 2
    return jnp.clip((gap - half) / half, 0.0, 1.0)


def scaled_logits(
    logits: jax.Array, params: SamplingParams, noise_key: jax.Array | None = None
) -> jax.Array:
    """z = (logits + sigma s n) / tau in float32; tau is taken as 1 when greedy.

    s = 1 (uniform noise) unless `noise_tail_gap` > 0, then s = `tail_ramp(logits, params)`.

    Args:
      logits: [b, v] raw logits (any float dtype; upcast to float32 here).
      params: sampling parameters.
      noise_key: [b] keys for the noise (only used when `noise_std > 0`); None: no noise.
    Returns:
      [b, v] float32.
    """
    z = logits.astype(jnp.float32)  # upcast before any softmax statistic
    if noise_key is not None:
        draw = lambda: jax.vmap(lambda k: jax.random.normal(k, z.shape[-1:], jnp.float32))(
            noise_key
        )

        def add_noise(z):
            return z + params.noise_std * draw()

        def add_tail_noise(z):
            return z + params.noise_std * (draw() * tail_ramp(z, params))

        # Runtime branches: with noise off (the default) no [b, v] normals are drawn at all, and
        # uniform noise runs the same branch whether or not the params carry a tail gap (so
        # noise_tail_gap = 0 is bit-identical to params without the field).
        branch = (params.noise_std > 0).astype(jnp.int32)
        branches = (lambda z: z, add_noise)
        if params.noise_tail_gap is not None:
            branch = branch * (1 + (params.noise_tail_gap > 0).astype(jnp.int32))
            branches += (add_tail_noise,)
        z = jax.lax.switch(branch, branches, z)
    tau = jnp.where(params.greedy, 1.0, params.temperature)
    return z / tau


class Truncation(NamedTuple):
    """The truncation set K of each row (E13), as the rollout records it.

    Attributes:
      kept_ids: `[b, W]` int32 ids of K in decreasing z, padded with -1; all -1 where the row
        was not truncated (K = the whole vocabulary). W = 0 when the engine has no truncation.
      truncated_mass: `[b]` float32 softmax(z) mass outside K (the truncation alone, before
        min-p), from the removed terms themselves.
    """

    kept_ids: jax.Array
    truncated_mass: jax.Array


def truncation(z: jax.Array, params: SamplingParams, kept_width: int) -> jax.Array:
    """`[b, W]` int32 kept ids of top-k then top-p on scaled logits z `[b, v]` (E13).

    Candidates are the W = min(`kept_width`, v) highest entries (`jax.lax.top_k`, ties to the
    lower id): K is the first r of them, r = min(k, W) with top-k (k = 0: W), then cut to the
    smallest prefix whose probability reaches p: rank j stays iff the mass of the ranks before
    it is below p times the denominator, which is the top-k set's sum with top-k on (the
    renormalised distribution) and the whole row's without. The argmax (rank 0) always stays. A
    top-p set larger than W is capped at W (documented with `max_kept`). Rows with top-k and
    top-p off get -1 only (no truncation). Cost per row: one top-W selection over v, then
    O(W) work; no sort of the vocabulary.
    """
    width = min(kept_width, z.shape[-1])
    # [b, W], decreasing. The barrier keeps the selection a TopK of its own: on XLA's CPU
    # backend a top_k whose values feed a fusion became a sort of the whole row (0.73 s
    # instead of 6 ms for [16, 151936]; benchmarks/truncation.py).
    vals, ids = jax.lax.optimization_barrier(jax.lax.top_k(z, width))
    k = jnp.int32(0) if params.top_k is None else params.top_k
    p = jnp.float32(1.0) if params.top_p is None else params.top_p
    rank = jnp.arange(width)
    keep = (k <= 0) | (rank[None, :] < k)  # top-k
    e = jnp.where(keep, jnp.exp(vals - vals[:, :1]), 0.0)  # exp(z - max z) of the candidates
    full = jnp.sum(jnp.exp(z - vals[:, :1]), axis=-1, keepdims=True)
    denominator = jnp.where(k > 0, jnp.sum(e, axis=-1, keepdims=True), full)
    before = jnp.cumsum(e, axis=-1) - e  # mass of the higher ranks
    keep = keep & ((p >= 1.0) | (before < p * denominator))
    keep = keep & ((k > 0) | (p < 1.0))  # neither on: no truncation
    kept = jnp.where(keep, ids, -1).astype(jnp.int32)
    return jnp.pad(kept, ((0, 0), (0, kept_width - width)), constant_values=-1)  # W > v


def sample(
    key: jax.Array,
    logits: jax.Array,
    params: SamplingParams,
    context: jax.Array | None = None,
    kept_width: int = 0,
) -> tuple[jax.Array, pruning.TokenLogprobs, Truncation]:
    """Draws one token per row from the pruned distribution mu_S (E4) and records its stats.

    The draw inverts the cumulative distribution of w_a = exp(z_a - max z) on V_S (0
    elsewhere, the exponentials `pruning.safe_set_sums` computes for the statistics) in two
    levels (`inverse_cdf_draw`): a vocabulary chunk with probability its share of sum w, then a
    token of that chunk with probability its share of the chunk: mu_S(a) = w_a / sum_b w_b
    exactly, from two uniforms per row. (A Gumbel-max or exponential race needs a random number
    per vocabulary entry: B x V threefry draws per decode step, 152k per row for Qwen3.)

    With `kept_width` W > 0, V_S is taken inside the truncation set K of top-k / top-p
    (`truncation`, E13) and the recorded `TokenLogprobs` (logp, pruned_mass, safe_size) are
    those of the distribution actually sampled from, mu_T over V_T = K cap V_S.

    Args:
      key: [b] PRNG keys, one per row (a row's draw depends only on its own key).
      logits: [b, v] raw next-token logits (float32 from the model).
      params: sampling parameters.
      context: [b] uint32 `context_hash` of each row's context, which fixes its logit noise;
        None: no noise whatever `params.noise_std` says.
      kept_width: static W, the most tokens a truncated row keeps (0: no top-k / top-p is
        compiled and the parameters' top_k / top_p are not read).
    Returns:
      (tokens [b] int32, `pruning.TokenLogprobs` with fields [b] of the sampled tokens under
      mu_S; `in_safe` is always True, so `logp` never holds `pruning.LOGP_FLOOR`; `Truncation`).
    """
    noise_keys = None
    if context is not None:
        base = jax.random.key(NOISE_SEED)
        noise_keys = jax.vmap(lambda c: jax.random.fold_in(base, c))(context)
    z = scaled_logits(logits, params, noise_keys)
    b = z.shape[0]
    if kept_width > 0:
        kept_ids = truncation(z, params, kept_width)
        kept = pruning.kept_mask(kept_ids, z.shape[-1])
    else:
        kept_ids, kept = jnp.zeros((b, 0), jnp.int32), None
    sums = pruning.safe_set_sums(z, params.log_rho, kept)  # E1-E3 core (E13 on K), traced
    w_safe = jnp.where(sums.safe, sums.exp_shifted, 0.0)  # in [0, 1], exactly 1 at the argmax
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,)))(key)  # [b, 2]
    sampled = inverse_cdf_draw(w_safe, u)
    tokens = jnp.where(params.greedy, first_argmax(z, sums.z_max), sampled)
    if kept is None:
        truncated_mass = jnp.zeros((b,), jnp.float32)
    else:  # from the removed terms, as E3 (no 1 - kept cancellation)
        removed = jnp.sum(jnp.where(kept, 0.0, sums.exp_shifted), axis=-1)
        truncated_mass = removed / (sums.sum_safe + sums.sum_out)[:, 0]
    return tokens, pruning.token_logprobs(sums, tokens), Truncation(kept_ids, truncated_mass)


# Vocabulary entries per chunk of the two-level draw: the second level's cumulative sum runs
# over one chunk, the first over V / CHUNK chunk sums (149 for Qwen3's 151,936).
DRAW_CHUNK = 1024


def inverse_cdf_draw(w: jax.Array, u: jax.Array) -> jax.Array:
    """[b] int32 index a drawn with probability w[a] / sum(w), from two uniforms per row.

    Level one: the chunk c (of `DRAW_CHUNK` entries) with the first cumulative chunk sum above
    u[:, 0] * sum(w); level two: the first entry of chunk c whose cumulative sum exceeds
    u[:, 1] * (the chunk's sum). An entry with w = 0 is never drawn (its cumulative sum equals
    the one before it); where float rounding puts a target at or past the last sum, the last
    chunk or entry with w > 0 is taken.

    Args:
      w: [b, v] non-negative weights, at least one positive per row.
      u: [b, 2] uniforms in [0, 1).
    """
    b, v = w.shape
    size = min(DRAW_CHUNK, v)
    chunks = -(-v // size)
    blocks = jnp.pad(w, ((0, 0), (0, chunks * size - v))).reshape(b, chunks, size)
    sums = blocks.sum(axis=-1)  # [b, c]

    def first_above(cumulative, target, weights):
        index = jnp.sum(cumulative <= target[:, None], axis=-1)
        positions = jnp.arange(weights.shape[-1])
        last_positive = jnp.max(jnp.where(weights > 0, positions, 0), axis=-1)
        return jnp.minimum(index, last_positive).astype(jnp.int32)

    cumulative = jnp.cumsum(sums, axis=-1)
    chunk = first_above(cumulative, u[:, 0] * cumulative[:, -1], sums)
    within = jnp.take_along_axis(blocks, chunk[:, None, None], axis=1)[:, 0]  # [b, size]
    cumulative = jnp.cumsum(within, axis=-1)
    entry = first_above(cumulative, u[:, 1] * cumulative[:, -1], within)
    return chunk * size + entry


def first_argmax(x: jax.Array, x_max: jax.Array | None = None) -> jax.Array:
    """[b] int32 index of the first maximum of each row of `x` [b, v] (`jnp.argmax` for rows
    without NaN), as two plain reductions: the row max (`x_max` [b, 1] if already known), then
    the smallest index attaining it. `jnp.argmax` is one (value, index) reduction, which XLA's
    CPU backend runs element by element: for the race over [16, 4096] it took twice as long."""
    if x_max is None:
        x_max = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == x_max, index, x.shape[-1]), axis=-1).astype(jnp.int32)
