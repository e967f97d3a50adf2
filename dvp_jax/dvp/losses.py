"""The DVP-RLOO policy-gradient loss (E5-E9) and its configuration.

`dvp_loss` is a pure function of arrays; the caller jits it and differentiates it with respect
to whatever produced `logp` (normally `chunked.chunked_pruned_logprobs`). Every weight
(E6, E7) and the advantage are stop-gradient constants, so the gradient is
  -(1/Z) sum_i sum_t w_it A_i grad log pi_S(y_it | s_it)                                    (E9)
The weights, the rejection rules, OPSM and batch normalisation (E7, E7b, E14-E17) are
`corrections`'; this module owns the config, E5, E6, E9 and the KL and entropy terms.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dvp_jax.dvp import batch_stats, corrections, diagnostics, pruning
from dvp_jax.dvp.segments import Segments

CORRECTIONS = (
    "none", "token_tis", "token_mis", "seq_tis", "seq_mis",
    # Rejection baselines (E7b): IcePop's two-sided token mask, geometric-mean and k3 sequence
    # rejection (verl's rollout correction `token_k1`, `seq_mean_k1`, `seq_mean_k3`).
    "token_icepop", "seq_geo_rs", "seq_k3_rs",
)  # fmt: skip
NORMALISATIONS = ("token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k3")  # E11
KL_REFERENCE_DTYPES = ("float32", "bfloat16")  # how the frozen reference params are kept

# Clamp on log(pi / pi_old) before exponentiating the PPO ratio, and on log(pi_ref / pi) in the
# k3 estimator (keeps them finite in float32).
_LOG_RATIO_BOUND = 20.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which DVP-RLOO objective to optimise (E1, E5, E7, E9).

    Attributes:
      prune: apply the min-p safe set (E1) on the trainer side and the E5 exclusion.
      log_rho: log of the min-p threshold rho, <= 0; -inf means the full vocabulary. Used only
        when `prune` is True (see `effective_log_rho`).
      correction: one of `CORRECTIONS` (E7).
      cap: C >= 1, the cap of the TIS/MIS corrections (E7).
      normalisation: `token_mean` (Z = kept tokens) or `seq_mean_token_sum` (Z = kept responses).
      ppo_clip_eps: None (one optimizer step per rollout batch) or eps in (0, 1) for the
        decoupled PPO clip over several steps (E9).
      temperature: tau > 0 applied to the trainer logits (E1, E2).
      kl_coef: beta >= 0 of the KL-to-reference term (E11); 0 = off (the paper's setting).
      kl_estimator: one of `KL_ESTIMATORS` (E11).
      kl_reference_dtype: one of `KL_REFERENCE_DTYPES`, the dtype the frozen reference params
        are kept in ("bfloat16" is the rollout precisions' parameter dtype, half the memory).
      entropy_coef: eta >= 0 of the entropy bonus (E12); 0 = off (the paper's setting).
      icepop_lo, icepop_hi: 0 < lo <= 1 <= hi, `token_icepop`'s band on the token ratio
        exp l_t (E7b; IcePop's 0.5 and 5).
      geo_lo, geo_hi: 0 < lo <= 1 <= hi, `seq_geo_rs`'s band on the response's geometric-mean
        ratio exp(mean_t l_t) (E7b; verl's example band 0.999..1.001).
      k3_max: > 0, `seq_k3_rs`'s bound on the response's mean k3 = exp l_t - 1 - l_t (E7b).
      rejection: rejection rules applied on top of `correction`, each with its band, all of
        which a token must pass (E14-E16): "" none, else `corrections.RULE_SYNTAX`, e.g.
        "seq_mean_k1=0.999:1.001,seq_max_k3=0.5,opsm=0.0005".
      batch_normalise_weights: divide the applied weights by their mean over the batch's kept
        tokens (token corrections) or kept responses (sequence corrections) (E17); needs
        kl_coef = entropy_coef = 0 (the mean scales the policy term only, and the update
        applies it to the gradient accumulated over micro-batches).
      mask_stale_tokens: partial rollouts: leave tokens sampled under older weights out of the
        loss (slime's option; the trainer clears them from the response mask).
    """

    prune: bool = True
    log_rho: float = pruning.DEFAULT_LOG_RHO
    correction: str = "none"
    cap: float = 2.0
    normalisation: str = "token_mean"
    ppo_clip_eps: float | None = None
    temperature: float = pruning.DEFAULT_TEMPERATURE
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_reference_dtype: str = "float32"
    entropy_coef: float = 0.0
    icepop_lo: float = 0.5
    icepop_hi: float = 5.0
    geo_lo: float = 0.999
    geo_hi: float = 1.001
    k3_max: float = 0.005
    rejection: str = ""
    batch_normalise_weights: bool = False
    mask_stale_tokens: bool = False

    def __post_init__(self):
        if not isinstance(self.prune, bool):
            raise ValueError(f"LossConfig.prune must be a bool, got {self.prune!r}.")
        pruning.check_log_rho(self.log_rho, "LossConfig.log_rho")
        if self.correction not in CORRECTIONS:
            raise ValueError(
                f"LossConfig.correction must be one of {CORRECTIONS}, got {self.correction!r}."
            )
        if not (isinstance(self.cap, int | float) and math.isfinite(self.cap) and self.cap >= 1):
            raise ValueError(
                f"LossConfig.cap must be a finite float >= 1 (weight 1 must be kept), "
                f"got {self.cap!r}."
            )
        if self.normalisation not in NORMALISATIONS:
            raise ValueError(
                f"LossConfig.normalisation must be one of {NORMALISATIONS}, "
                f"got {self.normalisation!r}."
            )
        eps = self.ppo_clip_eps
        if eps is not None and not (isinstance(eps, int | float) and 0 < eps < 1):
            raise ValueError(f"LossConfig.ppo_clip_eps must be None or in (0, 1), got {eps!r}.")
        pruning.check_temperature(self.temperature, "LossConfig.temperature")
        for name in ("kl_coef", "entropy_coef"):
            c = getattr(self, name)
            if not (isinstance(c, int | float) and math.isfinite(c) and c >= 0):
                raise ValueError(f"LossConfig.{name} must be a finite float >= 0, got {c!r}.")
        for lo, hi in (("icepop_lo", "icepop_hi"), ("geo_lo", "geo_hi")):
            a, b = getattr(self, lo), getattr(self, hi)
            ok = all(isinstance(v, int | float) and math.isfinite(v) for v in (a, b))
            if not (ok and 0 < a <= 1 <= b):
                raise ValueError(
                    f"LossConfig.{lo} and LossConfig.{hi} must be finite with "
                    f"0 < {lo} <= 1 <= {hi} (a band around ratio 1), got {a!r} and {b!r}."
                )
        k = self.k3_max
        if not (isinstance(k, int | float) and math.isfinite(k) and k > 0):
            raise ValueError(f"LossConfig.k3_max must be a finite float > 0, got {k!r}.")
        rules = corrections.parse_rules(self.rejection, "LossConfig.rejection")
        implied = _IMPLIED_RULE.get(self.correction)
        if implied and any(r.kind == implied for r in rules):
            raise ValueError(
                f"LossConfig.rejection repeats {implied}, which LossConfig.correction="
                f"{self.correction!r} already applies (E7b); drop one of them."
            )
        for name in ("batch_normalise_weights", "mask_stale_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LossConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.batch_normalise_weights and (self.kl_coef > 0 or self.entropy_coef > 0):
            raise ValueError(
                "LossConfig.batch_normalise_weights=True needs kl_coef = 0 and entropy_coef = 0 "
                f"(got {self.kl_coef} and {self.entropy_coef}): the batch mean scales the policy "
                "term only, applied to the gradient summed over micro-batches (E17)."
            )
        for name, allowed in [
            ("kl_estimator", KL_ESTIMATORS),
            ("kl_reference_dtype", KL_REFERENCE_DTYPES),
        ]:
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"LossConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}."
                )

    @property
    def effective_log_rho(self) -> float:
        """log_rho for `pruning.*`: -inf (no pruning) unless `prune`."""
        return float(self.log_rho) if self.prune else -math.inf

    @property
    def pruning(self) -> bool:
        """Whether the trainer safe set is a strict min-p set (and E5 applies)."""
        return self.effective_log_rho != -math.inf

    @property
    def rules(self) -> tuple[corrections.Rule, ...]:
        """The rejection rules in force (E14-E16): `seq_geo_rs` / `seq_k3_rs`'s own (E7b, as
        seq_mean_k1 / seq_mean_k3 with their bands) and then `rejection`'s."""
        own = {
            "seq_geo_rs": (corrections.Rule("seq_mean_k1", self.geo_lo, self.geo_hi),),
            "seq_k3_rs": (corrections.Rule("seq_mean_k3", 0.0, self.k3_max),),
        }.get(self.correction, ())
        return own + corrections.parse_rules(self.rejection)

    @property
    def uses_reference(self) -> bool:
        """Whether the loss has the KL-to-reference term (E11): reference params are kept and
        the batch carries `ref_logp` / `ref_in_safe`."""
        return self.kl_coef > 0

    @classmethod
    def preset(cls, name: str, **overrides) -> LossConfig:
        """The paper's methods (docs/design.md section 2), optionally with field overrides.

        rloo = no pruning + none; tis = no pruning + token_tis; mis = no pruning + seq_mis;
        dvp = pruning + none (with E5 exclusion); mis_dvp = pruning + seq_mis. Rejection
        baselines (E7b), no pruning: icepop = token_icepop; geo_rs = seq_geo_rs;
        k3_rs = seq_k3_rs. The peers' stacks (E14-E16), no pruning: skyrl_geo_tis,
        verl_seq_is_rs, opsm (see `PRESETS`).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown loss preset {name!r}; choose one of {tuple(PRESETS)}.")
        return cls(**(PRESETS[name] | overrides))


# The rule a rejection baseline of `CORRECTIONS` applies (E7b written as E15).
_IMPLIED_RULE = {"seq_geo_rs": "seq_mean_k1", "seq_k3_rs": "seq_mean_k3"}

PRESETS: dict[str, dict] = {
    "rloo": dict(prune=False, correction="none"),
    "tis": dict(prune=False, correction="token_tis"),
    "mis": dict(prune=False, correction="seq_mis"),
    "dvp": dict(prune=True, correction="none"),
    "mis_dvp": dict(prune=True, correction="seq_mis"),
    "icepop": dict(prune=False, correction="token_icepop"),
    "geo_rs": dict(prune=False, correction="seq_geo_rs"),
    "k3_rs": dict(prune=False, correction="seq_k3_rs"),
    # The peers' stacks (docs/design.md "Corrections across frameworks"), no pruning, each with
    # the peer's default bands: SkyRL's token TIS (cap 2) + geometric sequence mask 0.99..1.01;
    # verl's `decoupled_seq_is_rs` (sequence TIS, cap 2, + seq_sum_k1 0.5..2); OPSM with
    # slime's default delta 1e-4 (E16).
    "skyrl_geo_tis": dict(prune=False, correction="token_tis", rejection="seq_mean_k1=0.99:1.01"),
    "verl_seq_is_rs": dict(prune=False, correction="seq_tis", rejection="seq_sum_k1=0.5:2"),
    "opsm": dict(prune=False, correction="none", rejection="opsm=0.0001"),
}


def dvp_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    in_safe: jax.Array | None,
    cfg: LossConfig,
    old_logp: jax.Array | None = None,
    old_in_safe: jax.Array | None = None,
    *,
    ref_logp: jax.Array | None = None,
    ref_in_safe: jax.Array | None = None,
    entropy: jax.Array | None = None,
    segments: Segments | None = None,
    is_weight_norm: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DVP-RLOO loss (E5-E9, optionally + E11 + E12) of B rows of T tokens: one response per row
    (padded), or several packed sequences per row told apart by `segments`.

    E5: a response with any sampled token outside the trainer safe set (`in_safe` False on a
    response token, only when `cfg.pruning`) has token ratio 0: it is excluded from numerator and
    normaliser. With decoupled PPO the same holds for the old policy's safe set (`old_in_safe`):
    pi_S_old(y_t) = 0 makes the behaviour correction pi_old / mu_S zero, so a response is
    excluded when a sampled token is outside either safe set.
    E6: l_t = log pi_S(y_t) - log mu_S(y_t), L = sum_t l_t, stop-gradient.
    E7 with C = `cfg.cap` (compared in the log domain, l <= log C  <=>  exp l <= C):
      none: w = 1; token_tis: w_t = min(exp l_t, C); token_mis: w_t = exp l_t, token masked if
      exp l_t > C; seq_tis: w = min(exp L, C); seq_mis: w = exp L, response masked if exp L > C.
    E7b (rejection baselines; n_i = the response's included tokens):
      token_icepop: w_t = exp l_t, token masked unless lo <= exp l_t <= hi (`icepop_lo/hi`);
      seq_geo_rs: w = 1, response masked unless geo_lo <= exp(sum_t l_t / n_i) <= geo_hi;
      seq_k3_rs: w = 1, response masked if sum_t (exp l_t - 1 - l_t) / n_i > k3_max, with l_t
      clipped to +-20 (computed as expm1(l_t) - l_t).
    E14-E16 (`cfg.rules`: `cfg.rejection`'s, after seq_geo_rs / seq_k3_rs's own): a token is
      kept only if every rule keeps it (`corrections.rejection`); E17 (`cfg.
      batch_normalise_weights`): w / w_bar, w_bar the mean of the applied weights over the kept
      tokens (token corrections) or kept responses (seq_tis, seq_mis), or `is_weight_norm`.
    E9: loss = -(1/Z) sum_i sum_t w_it A_i log pi_S(y_it), sums over kept tokens;
      Z = kept tokens (`token_mean`) or kept responses (`seq_mean_token_sum`); masked tokens and
      responses leave Z; Z = 0 gives loss 0.
    Decoupled PPO (`cfg.ppo_clip_eps` = eps, needs `old_logp` = log pi_S_old from before the
    first optimizer step on this batch): l_t uses pi_old instead of pi (behaviour correction
    pi_old / mu_S), and each token term is multiplied by the stop-gradient factor r_t =
    exp(log pi_S - log pi_S_old), set to 0 where PPO's clip is active (A > 0 and r > 1 + eps, or
    A < 0 and r < 1 - eps). Its gradient equals that of the decoupled PPO-clip surrogate
    w min(r A, clip(r, 1 - eps, 1 + eps) A); the value equals E9 when r = 1 (the first step).
    E11 (`cfg.kl_coef` = beta > 0): + beta (1/Z) sum k_t over the kept tokens whose y_t is in the
      reference's safe set, d_t = log pi_ref_S(y_t) - log pi_S(y_t) clipped to +-20, k1 = -d_t,
      k3 = exp(d_t) - d_t - 1 (computed as expm1(d_t) - d_t); gradient through log pi_S only.
    E12 (`cfg.entropy_coef` = eta > 0): - eta (1/Z) sum H_t over the kept tokens' positions.

    Masked positions (`response_mask` False) and floors/-inf of out-of-safe-set tokens (on
    either side of the PPO ratio) are replaced with `jnp.where` before any arithmetic: they never
    change the loss or its gradient. The fraction of sampled tokens outside the trainer safe set
    is a diagnostic (`batch_stats.pruning_metrics`), not emitted here.

    Args:
      logp: `[B, T]` log pi_S(y_t) from the trainer (differentiable; E2).
      behaviour_logp: `[B, T]` log mu_S(y_t) recorded by the rollout (E4).
      advantages: `[B]` per-response advantage A_i (E8) of one response per row, broadcast over
        its tokens; or `[B, T]` per token (the A_i of the response each token belongs to: the
        packed layout).
      response_mask: `[B, T]` bool, True on response tokens.
      in_safe: `[B, T]` bool, y_t in the trainer's V_S; None means all inside. Ignored when
        pruning is off.
      cfg: `LossConfig`.
      old_logp: `[B, T]` log pi_S_old(y_t), required iff `cfg.ppo_clip_eps` is set.
      old_in_safe: `[B, T]` bool, y_t in the old policy's V_S; required when `old_logp` is given
        and pruning is on, ignored when pruning is off, not allowed without `old_logp`.
      ref_logp: `[B, T]` log pi_ref_S(y_t) of the frozen reference (the same pruning as `logp`),
        required iff `cfg.kl_coef > 0`.
      ref_in_safe: `[B, T]` bool, y_t in the reference's V_S; required with `ref_logp` when
        pruning is on, ignored when it is off.
      entropy: `[B, T]` H(pi_S(. | s_t)) (H(pi) unpruned), differentiable; required iff
        `cfg.entropy_coef > 0` (`chunked.PositionStats.policy_entropy`).
      segments: which response each token belongs to (`dvp/segments.py`); None: row b is one
        response. Every per-response quantity (E5's exclusion, L, the seq corrections, kept
        responses) is reduced per response either way, with the same values.
      is_weight_norm: E17's w_bar when the caller knows it (1.0: the raw weights, for a
        micro-batch whose batch mean the update applies afterwards); None: this call's own.

    Returns:
      `(loss, metrics)`: float32 scalar and a dict of float32 scalars (see `diagnostics` for
      frac_* and is_weight_*; plus loss, kept_tokens, kept_responses, ppo_clip_frac, and per
      rule `rejected/<kind>`, the share of response tokens it alone removes; with E11
      kl_ref, kl_ref_loss and, pruning, frac_tokens_outside_ref_safe; with E12 entropy_bonus).

    Raises:
      ValueError: `old_logp` given without `cfg.ppo_clip_eps` or the reverse; `old_in_safe`
        missing with `old_logp` under pruning, or given without `old_logp`; `ref_logp`,
      `ref_in_safe` or `entropy` given or missing against `cfg`; bad shapes.
    """
    _check_logp_pair(
        cfg, "old", old_logp, old_in_safe, cfg.ppo_clip_eps is not None,
        f"LossConfig.ppo_clip_eps is set (ppo_clip_eps={cfg.ppo_clip_eps}",
        "the old policy's safe set",
        " (LossConfig.prune=True, log_rho > -inf): old_logp holds a floor where it is False and "
        "those responses must be excluded (E5).",
    )  # fmt: skip
    _check_logp_pair(
        cfg, "ref", ref_logp, ref_in_safe, cfg.uses_reference,
        f"LossConfig.kl_coef > 0 (kl_coef={cfg.kl_coef}", "the reference's safe set",
        ": ref_logp holds a floor where it is False (E11).",
    )  # fmt: skip
    if (cfg.entropy_coef > 0) != (entropy is not None):
        raise ValueError(
            "entropy must be given exactly when LossConfig.entropy_coef > 0 "
            f"(entropy_coef={cfg.entropy_coef}, entropy given: {entropy is not None})."
        )
    if logp.ndim != 2 or advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"need logp [B, T] and advantages [B] or [B, T]; got {logp.shape}, {advantages.shape}."
        )
    f32 = jnp.float32
    seqs = segments or Segments()
    mask = response_mask.astype(bool)  # [B, T]

    # ----- E5: exclusion of responses with a sampled token outside a trainer safe set -----
    # (the current policy's, and with decoupled PPO also the old policy's)
    inside = jnp.ones_like(mask)
    if cfg.pruning:
        if in_safe is not None:
            inside = inside & in_safe.astype(bool)
        if old_in_safe is not None:
            inside = inside & old_in_safe.astype(bool)
    excluded = seqs.any(mask & ~inside)  # per response
    tok = mask & ~seqs.spread(excluded)  # [B, T] tokens of included responses, all inside V_S

    # ----- E6: stop-gradient log-ratios on included tokens only (no floor/-inf beyond here) ----
    lp = jnp.where(tok, logp.astype(f32), 0.0)
    lmu = jnp.where(tok, behaviour_logp.astype(f32), 0.0)
    if old_logp is not None:
        lold = jnp.where(tok, old_logp.astype(f32), 0.0)
        lref = lold
    else:
        lref = lp
    l_tok = jax.lax.stop_gradient(lref - lmu)  # [B, T], 0 off `tok`

    # ----- E7, E7b: weights; E14-E16: rejection rules; E17: batch-normalised weights -----
    adv = jax.lax.stop_gradient(advantages.astype(f32))
    adv = adv[:, None] if adv.ndim == 1 else adv  # [B, 1] or [B, T]
    w, token_masked, seq_masked = corrections.weights(
        cfg.correction, l_tok, tok, seqs, cap=cfg.cap, icepop_band=(cfg.icepop_lo, cfg.icepop_hi)
    )
    removed = {}
    if cfg.rules:
        l_now = jax.lax.stop_gradient(lp - lmu)  # OPSM's log pi / mu: the current policy
        rejected = corrections.rejection(cfg.rules, l_tok, l_now, tok, adv, seqs)
        token_masked, seq_masked = token_masked | rejected[0], seq_masked | rejected[1]
        removed = rejected[2]
    keep = tok & ~token_masked & ~seqs.spread(seq_masked)  # [B, T]
    w = jnp.where(keep, w, 0.0)
    per_response = cfg.correction in ("seq_tis", "seq_mis")
    if cfg.batch_normalise_weights:
        w = corrections.batch_normalise(w, keep, per_response, seqs, is_weight_norm)[0]

    # ----- E9 (+ decoupled PPO): weighted REINFORCE with stop-gradient coefficients -----
    coef = w * adv
    metrics = {}
    if cfg.ppo_clip_eps is not None:
        eps = cfg.ppo_clip_eps
        log_r = jnp.clip(lp - lold, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        r = jax.lax.stop_gradient(jnp.exp(log_r))
        clipped = keep & (((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps)))
        coef = coef * jnp.where(clipped, 0.0, r)
        metrics["ppo_clip_frac"] = diagnostics.masked_mean(clipped, keep)
    total = -jnp.sum(jnp.where(keep, coef * lp, 0.0))
    kept_responses = seqs.any(keep)  # per response
    if cfg.normalisation == "token_mean":
        z = jnp.sum(keep).astype(f32)
    else:
        z = jnp.sum(kept_responses).astype(f32)
    loss = total / jnp.maximum(z, 1.0)

    # ----- E11, E12: KL to the reference and the entropy bonus, over E9's tokens and Z -----
    if ref_logp is not None:
        kl_tok = keep & ref_in_safe.astype(bool) if cfg.pruning else keep
        d = jnp.where(kl_tok, ref_logp.astype(f32), 0.0) - jnp.where(kl_tok, lp, 0.0)
        d = jnp.clip(d, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        k = -d if cfg.kl_estimator == "k1" else jnp.expm1(d) - d
        k = jnp.where(kl_tok, k, 0.0)
        metrics["kl_ref"] = jax.lax.stop_gradient(diagnostics.masked_mean(k, kl_tok))
        metrics["kl_ref_loss"] = cfg.kl_coef * jnp.sum(k) / jnp.maximum(z, 1.0)
        if cfg.pruning:
            metrics["frac_tokens_outside_ref_safe"] = diagnostics.masked_mean(
                ~ref_in_safe.astype(bool), mask
            )
        loss = loss + metrics["kl_ref_loss"]
    if entropy is not None:
        h_sum = jnp.sum(jnp.where(keep, entropy.astype(f32), 0.0))
        metrics["entropy_bonus"] = -cfg.entropy_coef * h_sum / jnp.maximum(z, 1.0)
        loss = loss + metrics["entropy_bonus"]

    # ----- metrics -----
    metrics["loss"] = loss
    metrics["kept_tokens"] = jnp.sum(keep).astype(f32)
    metrics["kept_responses"] = jnp.sum(kept_responses).astype(f32)
    metrics |= batch_stats.exclusion_metrics(mask, excluded, seq_masked, token_masked, seqs)
    for kind, out in removed.items():
        metrics["rejected/" + kind] = diagnostics.masked_mean(out, mask)
    if per_response:
        # One weight per response: w is constant over a kept response's tokens, 0 elsewhere.
        metrics |= batch_stats.is_weight_stats(seqs.max(w), kept_responses)
    else:
        metrics |= batch_stats.is_weight_stats(w, keep)
    return loss, metrics


def weight_total(metrics: dict, cfg: LossConfig) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of the applied weights behind `metrics["is_weight_mean"]` (over the kept
    tokens, or the kept responses for seq_tis / seq_mis): E17's batch mean, summed over the
    micro-batches of an update."""
    per_response = cfg.correction in ("seq_tis", "seq_mis")
    count = metrics["kept_responses" if per_response else "kept_tokens"]
    return metrics["is_weight_mean"] * count, count


def _check_logp_pair(
    cfg: LossConfig, name: str, logp, in_safe, wanted: bool, when: str, safe_set: str, why: str
) -> None:
    """`<name>_logp` is given exactly when `wanted` (its condition `when`), and under pruning
    with its mask `<name>_in_safe` (y_t inside `safe_set`; `why` the floor it marks)."""
    if wanted != (logp is not None):
        raise ValueError(
            f"{name}_logp must be given exactly when {when}, "
            f"{name}_logp given: {logp is not None})."
        )
    if logp is None and in_safe is not None:
        raise ValueError(f"{name}_in_safe was given without {name}_logp; pass both or neither.")
    if logp is not None and cfg.pruning and in_safe is None:
        raise ValueError(
            f"{name}_in_safe (y_t inside {safe_set}) is required with {name}_logp when "
            f"pruning is on{why}"
        )
