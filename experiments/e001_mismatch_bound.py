"""e001 mismatch bound: the same params through the bf16 rollout path and the fp32 trainer path.

Question: does the rollout/trainer log-probability mismatch obey E10
  (|log p'_a - log p_a| <= 2 eps (1 - p_a), eps = max_b |z'_b - z_b|), is the error of *sampled*
  tail tokens biased (and in which direction), and how does the sequence log-ratio
  L_t = sum_{s<=t} l_s grow with length?
Params: the SFT-warmed tiny model (configs/tiny_cpu.py, 600 supervised steps, seed 0: exactly the
  policy RL starts from in the demo and in e002/e003), trained in-script with the trainer's own
  warm-up, or loaded with `--init_hf DIR` (e.g. the shared warm start of e002). Why not a random
  init: its logits are near-uniform (init_std 0.02), so p would sit at 1/V everywhere and say
  nothing about the (1 - p) shape; the warmed model has both confident (answer) and spread
  (operand digits, free-running continuations) positions.
Paths:
  * trainer: the fp32 `Transformer` full forward (TRAIN_POLICY), logits z.
  * rollout: the engine's computation in the rollout dtype policy, teacher-forced: the prompt is
    prefilled (positions inside the prompt use the same full forward the prefill runs), then
    every later token goes through `Transformer.decode` with the KV cache in the cache dtype
    (bf16, or float8_e4m3fn for `bfloat16_fp8kv`), logits z' upcast to fp32; with logit noise,
    z' + sigma n, n ~ N(0, I) (what `rollout.noise_std` adds before pruning).
  * the engine itself (`RolloutEngine` + `generate_rollouts`, log_rho = -inf, stop tokens off so
    every response has `--gen_len` tokens) samples continuations of held-out prompts and records
    log mu(y_t) (E4); the fp32 trainer scores the same tokens: l_t = log pi(y_t) - log mu(y_t).
Outputs (`--out`): e001_<setting>.png (4 panels: |log p' - log p| vs p with the 2 eps (1 - p)
  envelope; the same divided by eps against 2 (1 - p); mean signed l_t per trainer-probability
  bin for sampled vs teacher-forced tokens; L_t vs t) and e001.json (per setting: eps quantiles,
  fraction within the exact bound (E10 via `diagnostics.mismatch_bound`) and within the
  first-order bound 2 eps (1 - p_a), the per-bin tables, the growth curve, the fraction of sampled
  tokens outside the trainer's e^-13 safe set, and the engine-vs-teacher-forced consistency).
Command (from the repository root):
  python -m experiments.e001_mismatch_bound --out experiments/results/e001 [--smoke]
Hardware, times and the measured figures: experiments/README.md, e001.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dvp_jax.cli import use_compilation_cache
from dvp_jax.data import pipeline
from dvp_jax.dvp import diagnostics
from dvp_jax.model import TRAIN_POLICY, Transformer
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import generate_rollouts
from dvp_jax.tokenizers import load_tokenizer
from experiments import analyze, e001_plots

# (name, rollout dtype, logit noise std). The last is e002's level.
SETTINGS = (
    ("bf16", "bfloat16", 0.0),
    ("bf16_fp8kv", "bfloat16_fp8kv", 0.0),
    ("bf16_noise1", "bfloat16", 1.0),
    ("bf16_noise3", "bfloat16", 3.0),
)
SMOKE_SETTINGS = (SETTINGS[1],)  # fp8 KV: exercises the prefill + decode-through-cache path
# Sizes of `run` (each overridable): SFT steps of the warm-up, held-out sequences, samples per
# prompt and generated tokens of the sampled continuations.
SIZES = {"sft_steps": 600, "num_seqs": 256, "samples": 4, "gen_len": 40}
# Smoke: one sample per prompt of configs/tiny_cpu.py's decode length (6), so that the sampled
# batch has the held-out batch's shape and prompt lengths and each path compiles once.
SMOKE_SIZES = {"sft_steps": analyze.SMOKE["sft.steps"], "num_seqs": 16, "samples": 1, "gen_len": 6}
# Smoke: the warm-up of the smoke units of e002/e003 (`analyze.SMOKE`), whose compiled programs
# a caller's compilation cache then holds, and no event files.
SMOKE_CONFIG = {
    "sft.warmup_steps": analyze.SMOKE["sft.warmup_steps"],
    "sft.batch_size": analyze.SMOKE["sft.batch_size"],
    "train.trackers": "",
}
LOG_RHO = -13.0  # the paper's threshold, for the "outside the trainer safe set" count
# Trainer-probability bin edges for the signed l_t of sampled tokens (log-spaced in the tail).
P_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.05, 0.2, 0.5, 0.8, 0.95, 0.99, 1.0 + 1e-9)


# ------------------------------------------------------------------------------------------------
# Params.
# ------------------------------------------------------------------------------------------------
def warm_model(cfg, init_hf: str | None) -> Transformer:
    """The fp32 trainer model: loaded from an hf_export, or the trainer's own SFT warm-up."""
    if init_hf:
        from dvp_jax.model.hf_import import load_hf

        return load_hf(init_hf, TRAIN_POLICY, cfg=cfg.model)
    from dvp_jax.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(cfg, workdir)
        try:
            trainer.warm_up()
            return nnx.merge(trainer.graphdef, jax.device_get(trainer.state.params))
        finally:
            trainer.close()


# ------------------------------------------------------------------------------------------------
# The two paths.
# ------------------------------------------------------------------------------------------------
def trainer_logits(model: Transformer, tokens: np.ndarray, valid: np.ndarray) -> jax.Array:
    """fp32 full forward: z[b, t] predicts tokens[b, t + 1]; `[B, T, V]`."""
    graphdef, state = nnx.split(model)
    return _trainer_logits(graphdef, state, jnp.asarray(tokens), jnp.asarray(valid))


@functools.partial(jax.jit, static_argnums=0)  # one compile per model and shape, reused
def _trainer_logits(graphdef, state, tokens, valid):
    m = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return m(tokens, pos, valid)


def rollout_logits(
    model: Transformer, tokens: np.ndarray, valid: np.ndarray, prompt_lengths: np.ndarray
) -> jax.Array:
    """The engine's computation, teacher-forced: z'[b, t] predicts tokens[b, t + 1]; `[B, T, V]`.

    t < Lp - 1: the rollout-precision full forward (what prefill computes inside the prompt);
    t = Lp - 1: the prefill's output; t >= Lp: `decode` of tokens[b, t] at position t through the
    KV cache (cache dtype of the policy). Columns past a row's length hold garbage (masked later).
    """
    graphdef, state = nnx.split(model)
    p, steps = int(prompt_lengths.max()), tokens.shape[1] - int(prompt_lengths.min())
    args = (jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(prompt_lengths))
    return _rollout_logits(graphdef, p, steps, state, *args)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _rollout_logits(graphdef, p, steps, state, tokens, valid, lp):
    b, t = tokens.shape
    m = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    full = m(tokens, pos, valid)  # [B, T, V]
    first, cache = m.prefill(tokens[:, :p], lp, cache_len=t)  # [B, V]

    def step(cache, j):
        at = jnp.minimum(lp + j, t - 1)  # [B]
        tok = jnp.take_along_axis(tokens, at[:, None], axis=1)[:, 0]
        logits, cache = m.decode(tok, at, cache)
        return cache, logits

    _, dec = jax.lax.scan(step, cache, jnp.arange(steps))
    dec = jnp.moveaxis(dec, 0, 1)  # [B, J, V]: dec[b, j] predicts position lp + j + 1
    col = jnp.arange(t)[None, :]  # [1, T]
    j = jnp.clip(col - lp[:, None], 0, dec.shape[1] - 1)  # [B, T]
    from_dec = jnp.take_along_axis(dec, j[..., None], axis=1)  # [B, T, V]
    out = jnp.where((col < lp[:, None] - 1)[..., None], full, from_dec)
    return jnp.where((col == lp[:, None] - 1)[..., None], first[:, None, :], out)


def rollout_model(
    model: Transformer,
    dtype: str,
    prompt_len: int,
    gen_len: int,
    noise: float,
    slots: int,
    seed: int = 0,
) -> RolloutEngine:
    cfg = EngineConfig(
        dtype=dtype,
        noise_std=noise,
        max_concurrent_decodes=slots,
        max_prefill_length=prompt_len,
        prefill_buckets=(prompt_len,),
        max_decode_length=gen_len,
        log_rho=-math.inf,
        stop_tokens=(),
        seed=seed,
    )
    return RolloutEngine(model.cfg, cfg, tokenizer="char", params=nnx.state(model, nnx.Param))


# ------------------------------------------------------------------------------------------------
# Statistics.
# ------------------------------------------------------------------------------------------------
def bin_table(lr: np.ndarray, p: np.ndarray, edges=P_EDGES) -> list[dict]:
    """Mean signed / absolute log-ratio `lr` and its standard error per probability bin."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = (p >= lo) & (p < hi)
        n = int(sel.sum())
        x = lr[sel]
        out.append(
            {
                "p_lo": lo,
                "p_hi": min(hi, 1.0),
                "count": n,
                "mean_signed": float(x.mean()) if n else None,
                "stderr": float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
                "mean_abs": float(np.abs(x).mean()) if n else None,
            }
        )
    return out


def analyse_setting(model, name, dtype, noise, heldout, gen, key) -> dict:
    tok, valid, lp, pred = heldout  # pred[b, t]: column t predicts a real token t + 1
    t0 = time.time()
    engine = rollout_model(model, dtype, gen["prompt_len"], gen["gen_len"], noise, gen["slots"])
    rmodel = engine.model()

    # ---- E10 on held-out teacher-forced sequences (every vocabulary entry at every position).
    z = trainer_logits(model, tok, valid)
    zr = rollout_logits(rmodel, tok, valid, lp)
    if noise > 0:  # the same additive noise the sampler applies before pruning
        zr = zr + noise * jax.random.normal(jax.random.fold_in(key, 1), zr.shape, jnp.float32)
    sel = np.asarray(pred)
    zs, zrs = np.asarray(z)[sel], np.asarray(zr)[sel]  # [N, V]
    rep = diagnostics.mismatch_bound(zrs, zs)
    p = np.asarray(jax.nn.softmax(zs, axis=-1))
    diff, eps = np.asarray(rep.abs_logp_diff), np.asarray(rep.eps)
    first_order = diff <= 2.0 * eps[:, None] * (1.0 - p) + 1e-5 * eps[:, None]
    # Teacher-forced (not sampled by mu) next tokens: l = log pi - log mu at the true token.
    y = np.asarray(tok)[:, 1:][sel[:, :-1]]  # the last column never predicts a real token
    logp = np.asarray(jax.nn.log_softmax(zs, -1))
    logpr = np.asarray(jax.nn.log_softmax(zrs, -1))
    l_tf = logp[np.arange(len(y)), y] - logpr[np.arange(len(y)), y]
    p_tf = np.exp(logp[np.arange(len(y)), y])

    # ---- Sampled continuations through the engine (E4 records), scored by the fp32 trainer.
    batch = generate_rollouts(
        engine,
        gen["prompts"],
        gen["samples"],
        jax.random.fold_in(key, 2),
        prompt_len=gen["prompt_len"],
    )
    stok = batch.tokens
    svalid = batch.prompt_mask | batch.response_mask
    zt = np.asarray(jax.nn.log_softmax(trainer_logits(model, stok, svalid), -1))  # [N, T, V]
    nxt = stok[:, 1:]
    logp_tr = np.take_along_axis(zt[:, :-1], nxt[..., None], -1)[..., 0]  # [N, T-1]
    mask = batch.response_mask[:, 1:]
    logp_mu = batch.behaviour_logp_full[:, 1:]
    l_s = np.where(mask, logp_tr - logp_mu, 0.0)
    p_s = np.exp(logp_tr)[mask]
    # Outside the trainer's e^-13 safe set (E5 would exclude the response).
    gap = zt[:, :-1].max(-1) - np.where(mask, logp_tr, 0.0)
    outside = (gap > -LOG_RHO) & mask
    # Consistency: the engine's recorded log mu vs this script's teacher-forced rollout path.
    consistency = None
    if noise == 0:
        zr_s = np.asarray(
            jax.nn.log_softmax(rollout_logits(rmodel, stok, svalid, batch.prompt_lengths), -1)
        )
        lr_tf = np.take_along_axis(zr_s[:, :-1], nxt[..., None], -1)[..., 0]
        gap_tf = np.abs(lr_tf - logp_mu)[mask]
        consistency = {
            q: float(np.quantile(gap_tf, v))
            for q, v in (("median", 0.5), ("p99", 0.99), ("max", 1.0))
        }
    # Growth with length: cumulative sum over each response (all have gen_len tokens).
    resp = np.stack([l_s[i][mask[i]] for i in range(len(l_s))])  # [N, gen_len]
    cum = np.cumsum(resp, axis=1)
    growth = {
        "t": list(range(1, resp.shape[1] + 1)),
        "mean_L": cum.mean(0).tolist(),
        "std_L": cum.std(0).tolist(),
        "mean_abs_L": np.abs(cum).mean(0).tolist(),
        "mean_l_per_token": float(resp.mean()),
    }
    lt10 = {
        k: float(v)
        for k, v in diagnostics.lt_by_p_bins(
            jnp.asarray(l_s), jnp.asarray(np.exp(logp_tr)), jnp.asarray(mask)
        ).items()
    }
    res = {
        "setting": name,
        "rollout_dtype": dtype,
        "logit_noise": noise,
        "positions": int(len(eps)),
        "vocab": int(zs.shape[-1]),
        "eps": {
            "median": float(np.median(eps)),
            "p90": float(np.quantile(eps, 0.9)),
            "max": float(eps.max()),
        },
        "abs_logp_diff_max": float(diff.max()),
        "frac_within_exact_bound": float(rep.frac_within),
        "frac_within_first_order_bound": float(first_order.mean()),
        "sampled_tokens": int(mask.sum()),
        "frac_sampled_outside_train_safe_e-13": float(outside.sum() / max(mask.sum(), 1)),
        "frac_responses_with_token_outside_train_safe": float(outside.any(1).mean()),
        "sampled_bins": bin_table(l_s[mask], p_s),
        "teacher_forced_bins": bin_table(l_tf, p_tf),
        "lt_by_p_bins_sampled": lt10,
        "growth": growth,
        # |recorded log mu - teacher-forced rollout-path log mu| (noise-free settings only): the
        # same bf16 program at other batch shapes (engine: prefill batch 1, decode 64 slots;
        # here: all rows at once) rounds differently, so this is bf16 batch-shape variance.
        "engine_vs_teacher_forced_abs_diff": consistency,
        "time_s": time.time() - t0,
    }
    res["_plot"] = {"p": p, "diff": diff, "eps": eps}
    return res


# ------------------------------------------------------------------------------------------------
def run(out: str, smoke: bool = False, init_hf: str | None = None, seed: int = 0, **sizes) -> dict:
    """Every setting of SETTINGS (SMOKE_SETTINGS) at SIZES (SMOKE_SIZES) updated by `sizes`."""
    start = time.time()
    if set(sizes) - set(SIZES):
        raise TypeError(f"run() got {sorted(set(sizes) - set(SIZES))}; sizes are {list(SIZES)}")
    sizes = {
        **(SMOKE_SIZES if smoke else SIZES),
        **{k: v for k, v in sizes.items() if v is not None},
    }
    sft_steps, num_seqs, samples, gen_len = (sizes[k] for k in SIZES)
    settings = SMOKE_SETTINGS if smoke else SETTINGS
    # The warm-up recipe of the demo (configs/tiny_cpu.py), no RL.
    overrides = {"sft.steps": sft_steps, "train.steps": 0, "plots": False}
    cfg = analyze.tiny_config({**overrides, **(SMOKE_CONFIG if smoke else {})})
    tokenizer = load_tokenizer("char")
    model = warm_model(cfg, init_hf)
    task = cfg.data.make_task()
    examples = task.heldout_examples(num_seqs)
    max_len = cfg.sequence_length
    sb = pipeline.sft_batch(examples, tokenizer, max_len=max_len)
    tok, lengths = sb.tokens, sb.lengths
    valid = np.arange(max_len)[None, :] < lengths[:, None]
    pred = np.arange(max_len)[None, :] < (lengths - 1)[:, None]  # column t predicts t + 1
    heldout = (tok, valid, sb.prompt_lengths, pred)
    prompts = [list(tok[i, : sb.prompt_lengths[i]]) for i in range(len(examples))]
    gen = {
        "prompts": prompts,
        "samples": samples,
        "gen_len": gen_len,
        "prompt_len": cfg.data.max_prompt_len,
        "slots": min(64, num_seqs * samples),
    }
    key = jax.random.key(seed)
    os.makedirs(out, exist_ok=True)
    results = []
    for i, (name, dtype, noise) in enumerate(settings):
        res = analyse_setting(model, name, dtype, noise, heldout, gen, jax.random.fold_in(key, i))
        e001_plots.plot_setting(res, os.path.join(out, f"e001_{name}.png"))
        res.pop("_plot")
        results.append(res)
        b = res["sampled_bins"]
        tail = [r for r in b if r["p_hi"] <= 0.05 and r["count"]]
        n_tail = sum(r["count"] for r in tail)
        tail_mean = (sum(r["mean_signed"] * r["count"] for r in tail) / n_tail) if n_tail else None
        print(
            f"[e001] {name}: eps median {res['eps']['median']:.3g} max {res['eps']['max']:.3g}"
            f" | exact bound {res['frac_within_exact_bound']:.4f} | first order "
            f"{res['frac_within_first_order_bound']:.4f} | sampled p<0.05: n={n_tail} "
            f"mean l={tail_mean} | mean L_T {res['growth']['mean_L'][-1]:.4g} "
            f"| {res['time_s']:.0f} s",
            flush=True,
        )
    report = {
        "params": (
            {"init_hf": init_hf}
            if init_hf
            else {"sft_steps": sft_steps, "config": "configs/tiny_cpu.py", "seed": 0}
        ),
        "held_out_sequences": num_seqs,
        "samples_per_prompt": samples,
        "gen_len": gen_len,
        "smoke": smoke,
        "settings": results,
        "wall_time_s": time.time() - start,
    }
    with open(os.path.join(out, "e001.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results/e001")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--init_hf", default=None, help="an hf_export directory instead of SFT")
    for name in SIZES:
        ap.add_argument(f"--{name}", type=int, default=None, help="default: SIZES / SMOKE_SIZES")
    args = ap.parse_args(argv)
    if args.smoke:  # the caller's cache (a test session's), shared with the units' warm-up
        use_compilation_cache(os.environ.get("DVP_JAX_COMPILATION_CACHE", ""))
    sizes = {name: getattr(args, name) for name in SIZES}
    report = run(args.out, smoke=args.smoke, init_hf=args.init_hf, **sizes)
    print(f"[e001] wrote {args.out}/e001.json in {report['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
