"""Min-p sampling for rollouts: temperature, optional logit noise, safe-set pruning (E1, E4).

One step for a batch of rows, a pure function of arrays (`decode.step` calls it):

  z  = (logits + sigma * s * n(c)) / tau   sigma = `noise_std` (default 0), c = the context,
                                           s = 1, or the tail ramp (`tail_ramp`)
  V_S = { a : z_a >= max_b z_b + log_rho }  (E1; log_rho = -inf keeps the whole vocabulary)
  y  ~ mu_S = softmax(z restricted to V_S)  (E4, `inverse_cdf_draw`), or argmax z when greedy

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
    """

    temperature: jax.Array
    log_rho: jax.Array
    noise_std: jax.Array
    greedy: jax.Array
    noise_tail_gap: jax.Array | None = None

    @classmethod
    def create(
        cls,
        temperature: float = pruning.DEFAULT_TEMPERATURE,
        log_rho: float = pruning.DEFAULT_LOG_RHO,
        noise_std: float = 0.0,
        greedy: bool = False,
        noise_tail_gap: float = 0.0,
    ) -> SamplingParams:
        """Validated constructor from Python values (see `check_sampling_values`)."""
        check_sampling_values(temperature, log_rho, noise_std, noise_tail_gap)
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            log_rho=jnp.asarray(log_rho, jnp.float32),
            noise_std=jnp.asarray(noise_std, jnp.float32),
            greedy=jnp.asarray(bool(greedy)),
            noise_tail_gap=jnp.asarray(noise_tail_gap, jnp.float32),
        )


def check_sampling_values(
    temperature: float | None,
    log_rho: float | None,
    noise_std: float | None,
    noise_tail_gap: float | None = 0.0,
    owner: str = "SamplingParams",
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


def sample(
    key: jax.Array, logits: jax.Array, params: SamplingParams, context: jax.Array | None = None
) -> tuple[jax.Array, pruning.TokenLogprobs]:
    """Draws one token per row from the pruned distribution mu_S (E4) and records its stats.

    The draw inverts the cumulative distribution of w_a = exp(z_a - max z) on V_S (0
    elsewhere, the exponentials `pruning.safe_set_sums` computes for the statistics) in two
    levels (`inverse_cdf_draw`): a vocabulary chunk with probability its share of sum w, then a
    token of that chunk with probability its share of the chunk: mu_S(a) = w_a / sum_b w_b
    exactly, from two uniforms per row. (A Gumbel-max or exponential race needs a random number
    per vocabulary entry: B x V threefry draws per decode step, 152k per row for Qwen3.)

    Args:
      key: [b] PRNG keys, one per row (a row's draw depends only on its own key).
      logits: [b, v] raw next-token logits (float32 from the model).
      params: sampling parameters.
      context: [b] uint32 `context_hash` of each row's context, which fixes its logit noise;
        None: no noise whatever `params.noise_std` says.
    Returns:
      (tokens [b] int32, `pruning.TokenLogprobs` with fields [b] of the sampled tokens under
      mu_S; `in_safe` is always True, so `logp` never holds `pruning.LOGP_FLOOR`).
    """
    noise_keys = None
    if context is not None:
        base = jax.random.key(NOISE_SEED)
        noise_keys = jax.vmap(lambda c: jax.random.fold_in(base, c))(context)
    z = scaled_logits(logits, params, noise_keys)
    sums = pruning.safe_set_sums(z, params.log_rho)  # E1-E3 core, log_rho traced
    w_safe = jnp.where(sums.safe, sums.exp_shifted, 0.0)  # in [0, 1], exactly 1 at the argmax
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,)))(key)  # [b, 2]
    sampled = inverse_cdf_draw(w_safe, u)
    tokens = jnp.where(params.greedy, first_argmax(z, sums.z_max), sampled)
    return tokens, pruning.token_logprobs(sums, tokens)


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
