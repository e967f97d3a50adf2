"""e005 D: the coupled gradient bias of RLOO, TIS, MIS, DVP and MIS+DVP against fp32 RLOO.

`grad_unit(rung, chunk, ...)` reads the chunk's unpruned sample (saved by the sample unit, the
same prompts and sampler keys at every rung) and, at a rung other than M0, draws the pruned
sample (e^-13 on the rollout side, the same keys). Per prompt group of 16 and per T in
`e005_verdict.T_GRID` it takes the library's loss (`dvp_loss`, each method's `LossConfig`
preset) on the first T response tokens with RLOO advantages (E8) of the prefix reward, turns its
gradient with respect to the token log-probs into a parameter gradient by one VJP through the
trainer's `token_stats`, and count-sketches it to `SKETCH_DIM` coordinates (a fixed hash and
sign: inner products stay unbiased). `combine` then compares each rung's groups with M0's
(the same prompts and keys) and writes units/grad_<rung>.json. It does not train anything.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import types

import numpy as np

from experiments import e005_setup as mech
from experiments import e005_verdict as rules

SKETCH_V, SKETCH_D = 64, 16  # the sketch of a [d, V] gradient: K_V x K_D = 1,024 coordinates
SKETCH_DIM = SKETCH_V * SKETCH_D
BOOTSTRAP = 1000
UNPRUNED = ("rloo", "tis", "mis")
PRUNED = ("dvp", "mis_dvp")


def prefix_reward(words: list[str], operands: list[int]) -> float:
    """Share of the running-sum steps "+ a = s" written correctly, in order, in `words`."""
    want, total, good = [], 0, 0
    for a in operands:
        total += a
        want.append((str(a), str(total)))
    steps = [
        (words[i + 1], words[i + 3])
        for i in range(len(words) - 3)
        if words[i] == "+" and words[i + 2] == "="
    ]
    for j, step in enumerate(steps[: len(want)]):
        good += step == want[j]
    return good / len(want)


def prefix_rewards(tokenizer, rl, examples, samples: int) -> np.ndarray:
    """[len(T_GRID), N] prefix rewards of each response's first T tokens."""
    stop = set(getattr(tokenizer, "stop_tokens", ()) or ())
    out = np.zeros((len(rules.T_GRID), rl.tokens.shape[0]), np.float32)
    for i in range(rl.tokens.shape[0]):
        ids = [int(t) for t in rl.tokens[i, 1:][rl.response_mask[i]]]
        ops = [int(x) for x in examples[i // samples].key.split("+")]
        for j, t in enumerate(rules.T_GRID):
            text = tokenizer.decode([x for x in ids[:t] if x not in stop])
            out[j, i] = prefix_reward(text.split(), ops)
    return out


def _as_rl(batch):
    from dvp_jax.train.batch import from_rollouts

    return from_rollouts(batch, np.zeros(batch.tokens.shape[0], np.float32))


def load_sample(root: str, rung: str, chunk: int):
    with np.load(os.path.join(root, "samples", f"{rung}_c{chunk}.npz")) as f:
        return _as_rl(types.SimpleNamespace(**{k: f[k] for k in f.files}))


def _sketch_fns(model, cfg):
    """The jitted per-group sketch of the unembedding's gradient for stacked cotangents.

    With z_t = h_t W / tau, d log pi(y_t) / dW = (e_y - p_t) h_t^T / tau (p_t = softmax z_t; for
    DVP's log pi_S, p_S_t renormalised on the e^-13 safe set), so a cotangent c gives
    G(c) = sum_t c_t (e_y - p_t) h_t^T / tau. Its count sketch with the product hash
    (S_v (x) S_d, S_v: V -> K_V, S_d: d -> K_D) is A^T diag(c) B / tau with a_t = S_v(e_y - p_t),
    b_t = S_d h_t: every cotangent costs [N, K_V, K_D], not a backward pass.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dvp_jax.dvp import pruning

    graphdef, params = nnx.split(model, nnx.Param)
    vocab, d = model.cfg.vocab_size, model.cfg.d_model
    rng = np.random.default_rng(0)
    sign = lambda n: rng.choice(np.array([-1.0, 1.0], np.float32), n)
    m_v = np.zeros((vocab, SKETCH_V), np.float32)
    m_v[np.arange(vocab), rng.integers(0, SKETCH_V, vocab)] = sign(vocab)
    m_d = np.zeros((d, SKETCH_D), np.float32)
    m_d[np.arange(d), rng.integers(0, SKETCH_D, d)] = sign(d)
    tau = cfg.loss.temperature

    @jax.jit
    def sketches(params, tokens, positions, valid, cot_pruned, cot_full):
        m = nnx.merge(graphdef, params)
        h = m(tokens, positions, valid, return_hidden=True)[:, :-1]  # [B, T-1, d]
        hi = jax.lax.Precision.HIGHEST
        # [B, T-1, d] x [d, V] -> [B, T-1, V], float32 (the trainer's fp32 logits)
        z = jnp.einsum("btd,dv->btv", h, m.unembedding(), precision=hi) / tau
        sums = pruning.safe_set_sums(z, mech.LOG_RHO)  # E1-E3 on [B, T-1, V]
        p = sums.exp_shifted / (sums.sum_safe + sums.sum_out)  # pi
        ps = jnp.where(sums.safe, sums.exp_shifted, 0.0) / sums.sum_safe  # pi_S
        y = jnp.asarray(m_v)[tokens[:, 1:]]  # [B, T-1, K_V]: S_v e_y
        a_full = y - jnp.einsum("btv,vk->btk", p, m_v, precision=hi)
        a_pruned = y - jnp.einsum("btv,vk->btk", ps, m_v, precision=hi)
        b = jnp.einsum("btd,dl->btl", h, m_d, precision=hi)  # [B, T-1, K_D]
        # [C, B, T-1] cotangents -> [C, K_V, K_D] sketches of G(c)
        g = jnp.einsum("cbt,btk,btl->ckl", cot_full, a_full, b, precision=hi)
        g += jnp.einsum("cbt,btk,btl->ckl", cot_pruned, a_pruned, b, precision=hi)
        return (g / tau).reshape(g.shape[0], -1)

    return params, sketches, (m_v, m_d)


@functools.partial(__import__("jax").jit, static_argnums=0)
def _loss_grad(cfg, logp, behaviour_logp, adv, mask, in_safe):
    """d dvp_loss / d logp (the loss is linear in logp: its weights are stop-gradient)."""
    import jax

    from dvp_jax.dvp.losses import dvp_loss

    return jax.grad(lambda x: dvp_loss(x, behaviour_logp, adv, mask, in_safe, cfg)[0])(logp)


def cotangents(rl, st, sl, rewards, samples: int, methods, pruned_sample: bool):
    """d loss / d log-prob per (method, T) of one group: (names, [C, B, T-1] pruned, full)."""
    import jax.numpy as jnp

    from dvp_jax.dvp import advantages
    from dvp_jax.dvp.losses import LossConfig

    mask = np.asarray(rl.response_mask[sl])
    pos = np.cumsum(mask, axis=1)
    names, cp, cf = [], [], []
    zero = np.zeros(mask.shape, np.float32)
    for j, t in enumerate(rules.T_GRID):
        adv = advantages.rloo(jnp.asarray(rewards[j, sl]), samples)
        m_t = jnp.asarray(mask & (pos <= t))
        for m in methods:
            base = m.removesuffix("_out")
            cfg = LossConfig.preset(base)
            lp = st["logp"][sl] if cfg.pruning else st["logp_full"][sl]
            beh = rl.behaviour_logp[sl] if pruned_sample else rl.behaviour_logp_full[sl]
            c = np.asarray(_loss_grad(cfg, lp, beh, adv, m_t, st["in_safe"][sl]))
            if m.endswith("_out"):  # the tokens outside the trainer's e^-13 safe set only
                c = np.where(st["in_safe"][sl], 0.0, c)
            names.append(f"{m}@{t}")
            cp.append(c if cfg.pruning else zero)
            cf.append(zero if cfg.pruning else c)
    return names, np.stack(cp), np.stack(cf)


def grad_unit(rung: str, chunk: int, root: str, init_hf, smoke: bool = False) -> dict:
    """One chunk's per-group gradient sketches (saved under root/grads) and a small record."""
    from dvp_jax.tokenizers import load_tokenizer

    t0 = time.time()
    cfg = mech.rung_config(rung, smoke)
    model = mech.policy(cfg, init_hf)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    prompts, samples = (2, 2) if smoke else (mech.PROMPTS_PER_CHUNK, mech.SAMPLES)
    examples, first = mech.chunk_examples(cfg, chunk, prompts)
    parts = [("unpruned", load_sample(root, rung, chunk), UNPRUNED + ("rloo_out",))]
    if rung == "M0":
        parts[0] = ("unpruned", parts[0][1], ("rloo", "rloo_out"))
    else:
        _, pb = mech.sample(cfg, model, examples, first, mech.LOG_RHO, samples)
        parts.append(("pruned", _as_rl(pb), PRUNED))
    params, sketch, _ = _sketch_fns(model, cfg)
    arrays, summary = {}, {}
    for label, rl, methods in parts:
        st = mech.trainer_stats(cfg, model, rl)
        rewards = prefix_rewards(tokenizer, rl, examples, samples)
        mask, pos = np.asarray(rl.response_mask), np.cumsum(rl.response_mask, axis=1)
        delta = np.stack(
            [np.where(mask & (pos <= t), st["pruned_mass"], 0).sum(1) for t in rules.T_GRID]
        )
        rows = []
        for g in range(prompts):
            sl = slice(g * samples, (g + 1) * samples)
            names, cp, cf = cotangents(rl, st, sl, rewards, samples, methods, label == "pruned")
            rows.append(
                np.asarray(sketch(params, rl.tokens[sl], rl.positions[sl], rl.valid[sl], cp, cf))
            )
        sk = np.stack(rows)  # [G, C, K]
        for i, n in enumerate(names):
            arrays[f"{label}:{n}"] = sk[:, i]
        grp = lambda x: x.reshape(x.shape[0], prompts, samples).mean(-1)  # [T, G]
        arrays[f"{label}:reward"], arrays[f"{label}:delta"] = grp(rewards), grp(delta)
        summary[label] = {"mean_prefix_reward_by_T": rewards.mean(1).tolist()}
    os.makedirs(os.path.join(root, "grads"), exist_ok=True)
    np.savez_compressed(os.path.join(root, "grads", f"{rung}_c{chunk}.npz"), **arrays)
    return {
        "unit": f"grad_{rung}_c{chunk}",
        "rung": rung,
        "chunk": chunk,
        "groups": prompts,
        "responses": prompts * samples,
        "sketch_dim": SKETCH_DIM,
        **summary,
        "seconds": round(time.time() - t0, 1),
    }


# ------------------------------------------------------------------------------------------------
# Combining a rung's chunks with M0's.
# ------------------------------------------------------------------------------------------------
def _load(root: str, rung: str, chunks: int) -> dict | None:
    paths = [os.path.join(root, "grads", f"{rung}_c{k}.npz") for k in range(chunks)]
    if not all(os.path.exists(p) for p in paths):
        return None
    files = [np.load(p) for p in paths]
    axis = lambda k: 1 if k.endswith((":reward", ":delta")) else 0
    return {k: np.concatenate([f[k] for f in files], axis=axis(k)) for k in files[0].files}


def _sq_norm_debiased(x: np.ndarray) -> float:
    """||E x||^2 estimated from rows x_i: ||mean||^2 - tr Cov / n."""
    n = x.shape[0]
    m = x.mean(0)
    return float(m @ m - ((x - m) ** 2).sum() / max(n - 1, 1) / n)


def rel_bias(x: np.ndarray, ref: np.ndarray) -> float:
    """sqrt(||E x - E ref||^2 / ||E ref||^2), each squared norm debiased and floored at 0."""
    b2, r2 = _sq_norm_debiased(x - ref), _sq_norm_debiased(ref)
    return float(np.sqrt(max(b2, 0.0) / r2)) if r2 > 0 else float("nan")


def bias_sq_interval(
    d: np.ndarray, boot: int = BOOTSTRAP, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(estimate, lo, hi) of ||E d||^2 from rows d_i [n, K], the interval centred on the estimate.

    The estimate U is the noise-corrected squared norm (`_sq_norm_debiased`, the U-statistic
    sum_{i != j} d_i . d_j / (n (n - 1))), with Var U = 2 tr(Sigma^2) / (n (n - 1)) +
    4 mu' Sigma mu / n (mu = E d, Sigma = Cov d). Resampling the rows themselves is wrong here:
    a resample's U* is unbiased for the resampled population's ||mean d||^2, the plain squared
    norm, tr Cov / n above U, and its spread carries that noise again (e005's first interval did
    this and excluded 0 by construction where the noise term dominates). Instead the rows are
    centred (d_i - mean d) and resampled: U* of centred rows has the null distribution of U - mu
    (the first term of Var U, with its skew, but from the sample's tr(S^2), which overstates
    tr(Sigma^2) by ~(tr Sigma)^2 / n). The deviations are rescaled to the variance
    2 a2 / (n (n - 1)) + 4 max(mean' S mean - a2 / n, 0) / n, with a2 the unbiased (under
    normality) estimate of tr(Sigma^2), (n-1)^2 / ((n-2)(n+1)) (tr S^2 - (tr S)^2 / (n-1));
    the interval subtracts their quantiles from U. Coverage of a zero bias and power:
    experiments/e005_coverage.py.
    Resample counts w: U* = (||sum_k w_k c_k||^2 - sum_k w_k ||c_k||^2) / (n (n - 1)).
    """
    d = np.asarray(d, np.float64)
    n = d.shape[0]
    if n < 4:  # a2's estimate needs n >= 4 rows: no interval (the smoke's 2 groups)
        return _sq_norm_debiased(d), -math.inf, math.inf
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=boot).astype(np.float64)  # [B, n]
    m = d.mean(0)
    c = d - m  # [n, K] centred rows
    s = w @ c  # [B, K]: each resample's sum of centred rows
    dev = ((s * s).sum(1) - w @ (c * c).sum(1)) / (n * (n - 1))  # [B] null U*
    gram = c @ c.T / (n - 1)  # [n, n]: tr(S^2) = ||C C^T||_F^2 / (n - 1)^2
    tr_s2 = float((gram * gram).sum())
    m_s_m = float(((c @ m) ** 2).sum() / (n - 1))  # mean' S mean
    tr_s = float((c * c).sum() / (n - 1))
    a2 = (n - 1) ** 2 / ((n - 2) * (n + 1)) * (tr_s2 - tr_s**2 / (n - 1))
    target = 2.0 * max(a2, 0.0) / (n * (n - 1)) + 4.0 * max(m_s_m - a2 / n, 0.0) / n
    v0 = float(dev.var())
    scale = np.sqrt(target / v0) if v0 > 0 else 1.0
    est = _sq_norm_debiased(d)
    q_lo, q_hi = np.quantile(dev, [(1 - level) / 2, (1 + level) / 2]) * scale
    return est, float(est - q_hi), float(est - q_lo)


def method_stats(x: np.ndarray, ref: np.ndarray, seed: int = 0) -> dict:
    """Bias, cosine, variance and MSE of the per-group estimates x against ref (coupled rows).

    rel_bias_ci95: `bias_sq_interval` of the coupled differences x - ref, each end divided by
    the corrected ||E ref||^2 (the point estimate's denominator) and square-rooted, floored at 0.
    """
    n = x.shape[0]
    mx, mr = x.mean(0), ref.mean(0)
    var = float(((x - mx) ** 2).sum() / max(n - 1, 1))
    b2, lo, hi = bias_sq_interval(x - ref, seed=seed)
    r2 = _sq_norm_debiased(ref)
    diff = x - ref
    rel = lambda v: float(np.sqrt(max(v, 0.0) / r2)) if r2 > 0 else float("nan")
    return {
        "rel_bias": rel(b2),
        "rel_bias_ci95": [rel(lo), rel(hi)],
        "bias_sq": b2,
        "bias_sq_ci95": [lo, hi],
        "bias_noise_sq": float(((diff - diff.mean(0)) ** 2).sum() / max(n - 1, 1) / n),
        "ref_sq": r2,
        "ref_noise_sq": float(((ref - mr) ** 2).sum() / max(n - 1, 1) / n),
        "cosine": float(mx @ mr / max(np.linalg.norm(mx) * np.linalg.norm(mr), 1e-30)),
        "variance": var,
        "mse": max(b2, 0.0) + var,
        "rel_mse": (max(b2, 0.0) + var) / r2 if r2 > 0 else None,
    }


def combine(root: str, rung: str, chunks: int, samples: int = mech.SAMPLES) -> dict | None:
    """The gradient record of `rung` (units/grad_<rung>.json), once its chunks and M0's exist."""
    ref, run = _load(root, "M0", chunks), _load(root, rung, chunks)
    if ref is None or run is None:
        return None
    per_t = {}
    for j, t in enumerate(rules.T_GRID):
        r0 = ref[f"unpruned:rloo@{t}"]
        key = lambda m: f"{'pruned' if m in PRUNED else 'unpruned'}:{m}@{t}"  # noqa: B023
        row = {m: method_stats(run[key(m)], r0) for m in rules.METHODS if key(m) in run}
        b = (run[f"unpruned:rloo@{t}"] - r0).mean(0)
        b_out = (run[f"unpruned:rloo_out@{t}"] - ref[f"unpruned:rloo_out@{t}"]).mean(0)
        row["rloo_outside_share"] = float(b_out @ b / max(b @ b, 1e-30))
        if "pruned:reward" not in run:  # M0 against itself (a check): no pruned sample
            per_t[str(t)] = row
            continue
        dr = run["pruned:reward"][j] - ref["unpruned:reward"][j]  # [G], coupled groups
        row["dvp_objective"] = {
            "delta": float(dr.mean()),
            "se": float(dr.std(ddof=1) / np.sqrt(len(dr))),
            "B2": float(run["pruned:delta"][j].mean()),
        }
        per_t[str(t)] = row
    groups = r0.shape[0]
    return {
        "unit": f"grad_{rung}",
        "rung": rung,
        "groups": groups,
        "responses": groups * samples,
        "T": per_t,
    }


def combine_all(root: str, out: str, smoke: bool = False) -> list[str]:
    """Writes units/grad_<rung>.json for every rung whose chunks (and M0's) are all there."""
    written = []
    for rung in ("M1",) if smoke else rules.RUNGS:
        rec = combine(root, rung, *((1, 2) if smoke else (rules.REF_CHUNKS, mech.SAMPLES)))
        if rec is not None:
            with open(os.path.join(out, "units", f"grad_{rung}.json"), "w") as fh:
                json.dump(rec, fh, indent=1)
            written.append(rung)
    return written
