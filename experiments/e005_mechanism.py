"""e005: the paper's mechanism measured with power (selection bias, accumulation, gradient bias).

From e004's v3 warm start (configs/e004_running_sum.py), sampled at the rungs bf16, M1, M2, M3
and the synthetic M4 (a positive control), against fp32 M0. Units (each resumable, each well
under 15 minutes on one shared core; results/e005/units/<unit>.json, the bulky arrays as .npz
under --root):
  sample_<rung>_c<k>: 64 train prompts x 16 responses (prompts 64k..64k+63), RLOO's rollout
    (unpruned, budget 192, stop at EOS), scored by the fp32 trainer: per prompt group and
    trainer-probability bin, sums of d = log mu - log pi (A), the engine's computation
    teacher-forced on the first TF_PROMPTS groups and on every prompt's reference response
    (B, the control), and prefix sums D_T (C).
  grad_<rung>_c<k>: the coupled gradients (D, experiments/e005_gradients.py).
The rules are experiments/e005_verdict.py (committed first). Commands (repository root):
  python -m experiments.e005_mechanism --root /tmp/e005/root [--only sample_M1_c0] [--status]
  python -m experiments.e005_mechanism --smoke --root /tmp/e005_smoke   (CI sizes, random init)
The warm start: --init_hf DIR, else ROOT/e004_running_sum/_init_sft1000/hf_export (e004's
stage-0 command builds it). Hardware and times: experiments/README.md, e005.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from experiments import e005_gradients as grads
from experiments import e005_verdict as rules
from experiments.e005_setup import (
    PROMPTS_PER_CHUNK,
    SAMPLES,
    chunk_examples,
    policy,
    rung_config,
    sample,
    trainer_stats,
)

OUT = "experiments/results/e005"
TF_PROMPTS = 16  # groups per chunk also teacher-forced through the engine's computation (B)
T_CURVE = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192)  # includes rules.T_GRID; last: all tokens
# The sample's arrays the gradient units read back (`RolloutBatch` fields).
SAVED_FIELDS = ("tokens", "prompt_mask", "response_mask", "prompt_lengths") + tuple(
    f"behaviour_{k}" for k in ("logp", "logp_full", "pruned_mass", "safe_size")
)


# ------------------------------------------------------------------------------------------------
# Per-group sums (the records the rules read).
# ------------------------------------------------------------------------------------------------
def bin_sums(d, p, group, n_groups: int, extra: dict | None = None) -> dict:
    """[groups, bins] sums of 1, d, |d| (and each array of `extra`) per trainer-probability bin."""
    nb = len(rules.P_EDGES) - 1
    idx = np.clip(np.digitize(p, rules.P_EDGES[1:-1]), 0, nb - 1)
    cols = {"count": np.ones_like(d), "sum": d, "sum_abs": np.abs(d), **(extra or {})}
    out = {}
    for k, x in cols.items():
        acc = np.zeros((n_groups, nb))
        np.add.at(acc, (group, idx), np.asarray(x, float))
        out[k] = acc.tolist()
    return out


def accumulation_sums(d_tok, mask, group, n_groups: int) -> dict:
    """Per group and T of T_CURVE: tokens, sum D_T, sum D_T^2, logsumexp of L_T and 2 L_T."""
    from scipy.special import logsumexp

    pos = np.cumsum(mask, axis=1)
    out = {k: np.zeros((n_groups, len(T_CURVE))) for k in ("n", "sum", "sum_sq", "lse_L", "lse_2L")}
    for j, t in enumerate(T_CURVE):
        m = mask & (pos <= t)
        dt, nt = np.where(m, d_tok, 0.0).sum(1), m.sum(1)
        for g in range(n_groups):
            sel = group == g
            out["n"][g, j], out["sum"][g, j] = nt[sel].sum(), dt[sel].sum()
            out["sum_sq"][g, j] = (dt[sel] ** 2).sum()
            out["lse_L"][g, j] = logsumexp(-dt[sel])
            out["lse_2L"][g, j] = logsumexp(-2 * dt[sel])
    return {k: v.tolist() for k, v in out.items()}


def teacher_forced(model, rmodel, tokens, valid, prompt_lengths, targets, mask, rows: int = 16):
    """d = log mu - log pi of `targets` through both teacher-forced paths (e001's), per token of
    `mask`, with E10's eps per position: (d, p, |d| / eps, 2 (1 - p), within the exact bound)."""
    import jax

    from dvp_jax.dvp.diagnostics import mismatch_bound
    from experiments.e001_mismatch_bound import rollout_logits, trainer_logits

    outs = []
    for s in range(0, tokens.shape[0], rows):
        sl = slice(s, s + rows)
        z = trainer_logits(model, tokens[sl], valid[sl])[:, :-1]
        zr = rollout_logits(rmodel, tokens[sl], valid[sl], prompt_lengths[sl])[:, :-1]
        m = mask[sl]
        zs, zrs, y = np.asarray(z)[m], np.asarray(zr)[m], targets[sl][m]
        rep = mismatch_bound(zrs, zs, y)
        lp = np.asarray(jax.nn.log_softmax(zs, -1))[np.arange(len(y)), y]
        lq = np.asarray(jax.nn.log_softmax(zrs, -1))[np.arange(len(y)), y]
        p, eps = np.exp(lp), np.maximum(np.asarray(rep.eps), 1e-30)
        outs.append((lq - lp, p, np.abs(lq - lp) / eps, 2 * (1 - p), np.asarray(rep.within)))
    return [np.concatenate(x) for x in zip(*outs, strict=True)]


def _tf_part(model, rmodel, tokens, valid, lp, mask, group, n_groups):
    d, p, ratio, bound, within = teacher_forced(
        model, rmodel, tokens, valid, lp, tokens[:, 1:], mask
    )
    rows_group = np.broadcast_to(group[:, None], mask.shape)[mask]
    extra = {"sum_abs_over_eps": ratio, "sum_first_order_bound": bound, "within_exact": within}
    return bin_sums(d, p, rows_group, n_groups, extra)


# ------------------------------------------------------------------------------------------------
# The sample unit (A, B, C).
# ------------------------------------------------------------------------------------------------
def sample_unit(rung: str, chunk: int, root: str, init_hf, smoke: bool = False) -> dict:
    """Samples, scores and sums one chunk at `rung`; saves the arrays for the gradient units."""
    from dvp_jax.data import pipeline
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.batch import from_rollouts

    t0 = time.time()
    cfg = rung_config(rung, smoke)
    model = policy(cfg, init_hf)
    prompts = 2 if smoke else PROMPTS_PER_CHUNK
    examples, first = chunk_examples(cfg, chunk, prompts)
    engine, batch = sample(cfg, model, examples, first, -math.inf, 2 if smoke else SAMPLES)
    samples = batch.num_rows // len(examples)
    rl = from_rollouts(batch, np.zeros(batch.num_rows, np.float32))
    st = trainer_stats(cfg, model, rl)
    mask = np.asarray(rl.response_mask)
    d_tok = np.where(mask, rl.behaviour_logp_full - st["logp_full"], 0.0)
    group = np.arange(batch.num_rows) // samples
    rows_group = np.broadcast_to(group[:, None], mask.shape)[mask]
    bins = {"sampled": bin_sums(d_tok[mask], np.exp(st["logp_full"][mask]), rows_group, prompts)}
    # B and the control where a rung is judged; M4's noise is the engine's, not in these paths.
    if rung != "M0" and not cfg.rollout.noise_std:
        # Smoke: one group, so that the sampled rows have the reference rows' shape and prompt
        # lengths and each path compiles once (as TF_PROMPTS and the rows per pass do).
        tf_rows = (1 if smoke else TF_PROMPTS) * samples
        sl = slice(0, tf_rows)
        valid = np.asarray(rl.valid)
        bins["sampled_tf"] = _tf_part(
            model, engine.model(), rl.tokens[sl], valid[sl], batch.prompt_lengths[sl],
            mask[sl], group[sl], prompts,
        )  # fmt: skip
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        max_len = cfg.sequence_length
        sb = pipeline.sft_batch(examples, tokenizer, max_len=max_len)
        v = np.arange(max_len)[None, :] < sb.lengths[:, None]
        bins["reference"] = _tf_part(
            model, engine.model(), sb.tokens, v, sb.prompt_lengths,
            sb.loss_mask[:, 1:] > 0, np.arange(len(examples)), prompts,
        )  # fmt: skip
    os.makedirs(os.path.join(root, "samples"), exist_ok=True)
    path = os.path.join(root, "samples", f"{rung}_c{chunk}.npz")
    np.savez_compressed(path, **{k: getattr(batch, k) for k in SAVED_FIELDS})
    lengths = mask.sum(1)
    return {
        "unit": f"sample_{rung}_c{chunk}",
        "rung": rung,
        "rollout_dtype": cfg.rollout.dtype,
        "noise_std": cfg.rollout.noise_std,
        "chunk": chunk,
        "first_prompt": first,
        "responses": int(batch.num_rows),
        "samples_per_prompt": samples,
        "mean_length": float(lengths.mean()),
        "frac_outside_safe": float((mask & ~st["in_safe"]).sum() / max(mask.sum(), 1)),
        "bins": bins,
        "accumulation": {"T": list(T_CURVE), "D": accumulation_sums(d_tok, mask, group, prompts)},
        "seconds": round(time.time() - t0, 1),
    }


# ------------------------------------------------------------------------------------------------
# Driver.
# ------------------------------------------------------------------------------------------------
def unit_names(smoke: bool = False) -> list[str]:
    """Every unit in run order: M0 and rung samples before the gradient chunks that read them."""
    if smoke:
        return ["sample_M0_c0", "sample_M1_c0", "grad_M0_c0", "grad_M1_c0"]
    # Chunk-major, the real rungs first, so that a budget cut short leaves every rung's first
    # chunks; M0's samples before any gradient chunk, which reads them.
    order = ("M1", "M3", "M4", "bf16", "M2")
    names = [f"sample_{r}_c{k}" for k in range(rules.CHUNKS) for r in order]
    names += [f"sample_M0_c{k}" for k in range(rules.REF_CHUNKS)]
    names += [f"grad_{r}_c{k}" for k in range(rules.REF_CHUNKS) for r in ("M0", *order)]
    assert sorted(names) == sorted(rules.expected_units()), "unit lists disagree"
    return names


def run_unit(name: str, root: str, out: str, init_hf, smoke: bool = False) -> dict:
    kind, rung, chunk = name.split("_")
    fn = sample_unit if kind == "sample" else grads.grad_unit
    rec = fn(rung, int(chunk[1:]), root, init_hf, smoke)
    os.makedirs(os.path.join(out, "units"), exist_ok=True)
    path = os.path.join(out, "units", f"{name}.json")
    with open(path + ".tmp", "w") as fh:  # a kill mid-write leaves no half record
        json.dump(rec, fh)
    os.replace(path + ".tmp", path)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="/tmp/e005/root", help="bulky arrays (.npz), not committed")
    p.add_argument("--out", default=OUT, help="results folder (units/, verdict.json, plots)")
    p.add_argument("--init_hf", default=None, help="the warm start's hf_export")
    p.add_argument("--only", default="", help="comma-separated unit names (default: all missing)")
    p.add_argument("--max_units", type=int, default=0, help="stop after this many (0: all)")
    p.add_argument("--status", action="store_true", help="print which units are missing")
    p.add_argument("--smoke", action="store_true", help="CI sizes on a random init")
    p.add_argument(
        "--compilation_cache", default=None, help="default ROOT/jax_cache, none with --smoke"
    )
    args = p.parse_args(argv)
    from dvp_jax.cli import use_compilation_cache

    cache = args.compilation_cache  # smoke: the caller's (pytest's) cache stays as it is
    default = "" if args.smoke else os.path.join(args.root, "jax_cache")
    use_compilation_cache(default if cache is None else cache)
    done = set(rules.load_units(args.out))
    todo = [n for n in unit_names(args.smoke) if n not in done]
    if args.only:
        todo = [n for n in args.only.split(",") if n]
    if args.status:
        print(rules.status_line(rules.load_units(args.out)))
        return 0
    init_hf = None if args.smoke else args.init_hf
    if not args.smoke and not init_hf:
        init_hf = os.path.join(args.root, "e004_running_sum", "_init_sft1000", "hf_export")
    for i, name in enumerate(todo):
        if args.max_units and i >= args.max_units:
            break
        rec = run_unit(name, args.root, args.out, init_hf, args.smoke)
        print(f"[e005] {name}: {rec['seconds']} s", flush=True)
    grads.combine_all(args.root, args.out, args.smoke)
    rules.main(["--out", args.out])
    if not args.smoke:
        from experiments import e005_plots

        e005_plots.plot_all(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
