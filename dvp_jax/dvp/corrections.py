"""The off-policy corrections of the loss: E7's importance weights, E7b's rejection baselines,
the combinable rejection rules (E14-E15), OPSM (E16) and batch-normalised weights (E17).

Pure functions of `[B, T]` arrays, called by `losses.dvp_loss` (which owns E5, E6 and E9); the
rule syntax of `LossConfig.rejection` is parsed and validated here, once. Nothing here sees a
config object: `dvp_loss` passes the fields it needs.

Every per-response quantity is reduced per response with `Segments` (`dvp/segments.py`), so
packed rows compute what padded rows compute.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dvp_jax.dvp.segments import Segments

# Clamp on a log-ratio before an exponential (exp(20) is finite in float32).
LOG_RATIO_BOUND = 20.0

# ----------------------------------------------------------------------------- rules (E14-E16)

# Per-token statistic of the log-ratio l_t (E14): k1 = l_t (its band is on the ratio), k2 =
# l_t^2 / 2, k3 = exp(l_t) - 1 - l_t. Aggregations (E15): the token itself, or per response
# the sum, the mean or the max over its included tokens. The names are verl's `rollout_rs`
# options; `opsm` is DeepSeek-V3.2's off-policy sequence masking (E16).
RULE_KINDS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
    "opsm",
)  # fmt: skip
RULE_SYNTAX = (
    "NAME=BAND[,NAME=BAND...] with token_k1 | seq_sum_k1 | seq_mean_k1 = LO:HI "
    "(0 < LO <= 1 <= HI); token_k2 | token_k3 | seq_sum_k2 | seq_sum_k3 | seq_mean_k2 | "
    "seq_mean_k3 | seq_max_k2 | seq_max_k3 = MAX (> 0); opsm = DELTA (>= 0); each name once"
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rejection rule: `kind` (one of `RULE_KINDS`) and its band.

    k1 rules keep lo <= exp(aggregated l) <= hi; k2 / k3 rules keep aggregated statistic <= hi;
    opsm's hi is delta (lo unused).
    """

    kind: str
    lo: float
    hi: float

    @property
    def token_level(self) -> bool:
        return self.kind.startswith("token_")


def parse_rules(spec: str, field: str = "LossConfig.rejection") -> tuple[Rule, ...]:
    """The rules of `spec` (`RULE_SYNTAX`); "" is none. A bad entry raises one ValueError line
    naming `field`, the entry, what was wrong and the syntax."""
    if not isinstance(spec, str):
        raise ValueError(f"{field} must be a string ({RULE_SYNTAX}), got {spec!r}.")
    rules = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, eq, band = (s.strip() for s in entry.partition("="))
        bad = lambda why, e=entry: ValueError(
            f"{field} entry {e!r}: {why}; allowed: {RULE_SYNTAX}."
        )
        if name not in RULE_KINDS:
            raise bad(f"unknown rule {name!r}")
        if not eq or not band:
            raise bad("missing '=BAND'")
        if any(r.kind == name for r in rules):
            raise bad(f"{name} given twice")
        parts = band.split(":")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise bad(f"band {band!r} is not a number") from None
        if not all(math.isfinite(v) for v in values):
            raise bad("band must be finite")
        if name.endswith("_k1"):
            if len(values) != 2 or not 0 < values[0] <= 1 <= values[1]:
                raise bad("a k1 rule needs a ratio band LO:HI with 0 < LO <= 1 <= HI")
            rules.append(Rule(name, values[0], values[1]))
            continue
        if len(values) != 1:
            raise bad("this rule takes one number, not a LO:HI band")
        if name == "opsm" and values[0] < 0:
            raise bad("opsm's delta must be >= 0")
        if name != "opsm" and values[0] <= 0:
            raise bad("the upper bound must be > 0")
        rules.append(Rule(name, 0.0, values[0]))
    return tuple(rules)


def _token_statistic(kind: str, l_tok: jax.Array) -> jax.Array:
    """E14's per-token statistic of l_t `[B, T]` (l_t for k1; k2, k3 clip l_t to +-20)."""
    if kind.endswith("_k1"):
        return l_tok
    lc = jnp.clip(l_tok, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if kind.endswith("_k2"):
        return 0.5 * lc * lc
    return jnp.expm1(lc) - lc  # k3 = exp(l) - 1 - l >= 0, accurate near l = 0


def rejection(
    rules: tuple[Rule, ...],
    l_tok: jax.Array,
    l_now: jax.Array,
    tok: jax.Array,
    advantages: jax.Array,
    seqs: Segments,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Which tokens and responses the rules reject (E14-E16); every rule must keep a token.

    Args:
      rules: from `parse_rules`.
      l_tok: `[B, T]` E6's stop-gradient l_t (pi or, with decoupled PPO, pi_old over mu_S), 0 off
        `tok`.
      l_now: `[B, T]` log pi_S - log mu_S with the current policy (OPSM's, E16), 0 off `tok`.
      tok: `[B, T]` bool, tokens of included responses (E5).
      advantages: `[B, 1]` or `[B, T]` A of each token's response.
      seqs: which response each token belongs to.

    Returns:
      token_rejected `[B, T]` (token rules), seq_rejected per response (sequence rules and
      OPSM, only responses with included tokens), and per rule `[B, T]` the tokens it alone
      removes (`rejected/<kind>` metrics).
    """
    f32 = jnp.float32
    n_tok = jnp.maximum(seqs.sum(tok.astype(f32)), 1.0)  # per response
    has_tok = seqs.any(tok)
    token_rejected = jnp.zeros_like(tok)
    seq_rejected = jnp.zeros_like(has_tok)
    removed = {}
    for rule in rules:
        if rule.kind == "opsm":  # E16: negative advantage and mean log(mu / pi) > delta
            kl = -seqs.sum(l_now) / n_tok
            negative = seqs.any(tok & (jnp.broadcast_to(advantages, tok.shape) < 0))
            out = has_tok & negative & (kl > rule.hi)
        else:
            stat = jnp.where(tok, _token_statistic(rule.kind, l_tok), 0.0)
            if rule.token_level:
                agg = stat
            elif rule.kind.startswith("seq_sum_"):
                agg = seqs.sum(stat)
            elif rule.kind.startswith("seq_mean_"):
                agg = seqs.sum(stat) / n_tok
            else:  # seq_max_k2 / k3: the response's worst token (stat >= 0, 0 off `tok`)
                agg = seqs.max(stat)
            if rule.kind.endswith("_k1"):  # ratio band on exp(agg), compared in the log domain
                out = (agg < math.log(rule.lo)) | (agg > math.log(rule.hi))
            else:
                out = agg > rule.hi
        if rule.token_level:
            out = tok & out
            token_rejected = token_rejected | out
            removed[rule.kind] = out
        else:
            out = has_tok & out
            seq_rejected = seq_rejected | out
            removed[rule.kind] = tok & seqs.spread(out)
    return token_rejected, seq_rejected, removed


# ----------------------------------------------------------------------------- E7, E7b weights


def weights(
    correction: str,
    l_tok: jax.Array,
    tok: jax.Array,
    seqs: Segments,
    *,
    cap: float,
    icepop_band: tuple[float, float],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """E7's weights w `[B, T]` and their masks, for `correction` (none, token_/seq_ tis and mis,
    token_icepop; seq_geo_rs and seq_k3_rs weigh 1 and reject through `rejection`).

    Returns (w, token_masked `[B, T]`, seq_masked per response). w may be anything on masked
    or excluded tokens: the caller zeroes it off its kept tokens.
    """
    log_cap = math.log(cap)
    token_masked = jnp.zeros_like(tok)
    has_tok = seqs.any(tok)  # per response: included (E5) and with response tokens
    seq_masked = jnp.zeros_like(has_tok)
    l_seq = seqs.sum(l_tok)
    if correction == "token_tis":
        w = jnp.exp(jnp.minimum(l_tok, log_cap))
    elif correction == "token_mis":
        token_masked = tok & (l_tok > log_cap)
        w = jnp.exp(jnp.minimum(l_tok, log_cap))
    elif correction in ("seq_tis", "seq_mis"):
        if correction == "seq_mis":
            seq_masked = has_tok & (l_seq > log_cap)
        w = jnp.broadcast_to(seqs.spread(jnp.exp(jnp.minimum(l_seq, log_cap))), l_tok.shape)
    elif correction == "token_icepop":
        lo, hi = math.log(icepop_band[0]), math.log(icepop_band[1])
        token_masked = tok & ((l_tok < lo) | (l_tok > hi))
        w = jnp.exp(jnp.clip(l_tok, lo, hi))  # finite everywhere; masked tokens get 0 later
    else:  # none, seq_geo_rs, seq_k3_rs
        w = jnp.ones_like(l_tok)
    return w, token_masked, seq_masked


# ----------------------------------------------------------------------------- E17


def batch_normalise(
    w: jax.Array, keep: jax.Array, per_response: bool, seqs: Segments, norm: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """E17: w / w_bar with w_bar the mean applied weight over E9's kept tokens (token
    corrections) or kept responses (sequence corrections), or the given `norm`.

    Returns (normalised w, sum of the raw weights, their count) over the same set, the
    update's pieces of the batch mean when the batch is split into micro-batches.
    """
    if per_response:
        kept = seqs.any(keep)
        raw = jnp.where(kept, seqs.max(jnp.where(keep, w, 0.0)), 0.0)
    else:
        kept, raw = keep, w
    total = jnp.sum(jnp.where(kept, raw, 0.0))
    count = jnp.sum(kept).astype(jnp.float32)
    if norm is None:
        norm = total / jnp.maximum(count, 1.0)
    norm = jnp.where(norm > 0, norm, 1.0)  # no kept weight: nothing to scale
    return w / jax.lax.stop_gradient(norm), total, count
