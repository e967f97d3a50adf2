"""e007's gate and weight-drift control: the rung's sampler on a policy, scored by the fp32 trainer.

`measure` draws GATE_PROMPTS x GATE_SAMPLES responses to fixed train prompts from the M3 engine
without pruning (RLOO's sampler) on a policy's weights and scores them with the fp32 trainer: the
share of sampled response tokens outside the trainer's e^-13 safe set, the tail's share of
sum |log mu - log pi|, the mean log mu - log pi (full_kl_k1) and its parts inside / outside, the
entropy. On the warm start it is the gate (`gate.json`, judged by e007_verdict.gate_status); on
the fp32 arm's weights at each segment end it is the weight-drift control (e007_tail).

Commands (repository root):
  python -m experiments.e007_gate --init_hf /tmp/e007/root/e007_tail/_warm/hf_export
  python -m experiments.e007_gate --smoke --out /tmp/e007_gate_smoke   (CI: a random model at the
      CI sizes; never the committed results folder)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from dvp_jax.workdir import write_atomic
from experiments import e007_verdict as rules
from experiments.provenance import code_version, weights_hash

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/e007_tail_sum.py"
OUT = "experiments/results/e007"
LOG_RHO = -13.0  # the trainer's safe set (the paper's rho)
SMOKE = {  # CI sizes on a random init: a 2,000-word vocabulary, 4 free words per step
    "data.tokenizer": "running_sum:2000",
    "data.tail_sum.n_words": 2000,
    "data.tail_sum.thoughts_per_step": 4,
    "model.d_model": 32,
    "model.head_dim": 8,
    "model.d_ff": 64,
    "rollout.max_decode_length": 20,
    "model.max_position_embeddings": 32,
}


def config(method: str, rung: str, smoke: bool = False, overrides: dict | None = None):
    """The validated `ExperimentConfig` of configs/e007_tail_sum.py for `method` at `rung`."""
    from dvp_jax.pyfile import load_file
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    cd = load_file(os.path.join(REPO, CONFIG)).get_config(f"{method}:{rung}")
    cd.lock()
    cd.update_from_flattened_dict({**(SMOKE if smoke else {}), **(overrides or {})})
    return ExperimentConfig.from_config_dict(cd, load_tokenizer(cd.data.tokenizer).vocab_size)


def policy(cfg, init_hf: str | None):
    """The fp32 trainer model: the weights of `init_hf`, or a random init (smoke)."""
    from experiments.e005_setup import policy as load

    return load(cfg, init_hf)


def trainer_scores(cfg, model, rl, rows: int = 32) -> dict:
    """The fp32 trainer's per-token log pi(y) (unpruned), log pi(y) / max pi, entropy and the
    mass outside its safe set (delta_S, E3), each [N, T-1] NumPy, `rows` at a time."""
    import functools

    import jax
    from flax import nnx

    from dvp_jax.train.step import token_stats

    graphdef, params = nnx.split(model, nnx.Param)
    fn = jax.jit(
        functools.partial(
            token_stats,
            graphdef=graphdef,
            log_rho=LOG_RHO,
            temperature=cfg.loss.temperature,
            chunk_size=cfg.train.chunk_size,
        )
    )
    parts = {}
    for s in range(0, rl.tokens.shape[0], rows):
        sl = slice(s, s + rows)
        tl, st = fn(
            params, tokens=rl.tokens[sl], positions=rl.positions[sl], segment_ids=rl.valid[sl]
        )
        named = (
            ("logp_full", tl.logp_full),
            ("log_rel", st.log_rel),
            ("entropy", st.entropy),
            ("pruned_mass", tl.pruned_mass),
        )
        for k, x in named:
            parts.setdefault(k, []).append(np.asarray(x))
    return {k: np.concatenate(v) for k, v in parts.items()}


def figures(d: np.ndarray, log_rel: np.ndarray, entropy: np.ndarray, mask: np.ndarray) -> dict:
    """The gate's figures from per-token d = log mu - log pi, log pi(y)/max pi, H(pi) and the
    response mask, all [N, T]."""
    m = mask.astype(bool)
    out_ = m & (log_rel < LOG_RHO)
    n = max(int(m.sum()), 1)
    abs_all = float(np.abs(d[m]).sum())
    return {
        "tokens": int(m.sum()),
        "outside_share": float(out_.sum() / n),
        "tail_abs_share": float(np.abs(d[out_]).sum() / abs_all) if abs_all > 0 else 0.0,
        rules.PRIMARY: float(d[m].sum() / n),
        "full_kl_k1_inside": float(d[m & ~out_].sum() / n),
        "full_kl_k1_outside": float(d[out_].sum() / n),
        "mean_abs_d_inside": float(np.abs(d[m & ~out_]).mean()) if (m & ~out_).any() else 0.0,
        "mean_abs_d_outside": float(np.abs(d[out_]).mean()) if out_.any() else 0.0,
        "entropy": float(entropy[m].mean()),
    }


def by_kind(cfg, targets, d, log_rel, mask) -> dict:
    """The figures split by what the sampled token is: the head word (word 0), another (tail)
    word, or a structure token (numbers, markers, EOS): each kind's share of the tokens, its mean
    |d|, its share of sum |d|, the share of it outside the safe set and its median log_rel."""
    from dvp_jax.data import running_sum
    from dvp_jax.tokenizers import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    head = tok.encode_ids(running_sum.thought_words(1)[0])[0]  # words follow the numbers
    m = mask.astype(bool)
    kinds = {
        "head": m & (targets == head),
        "tail_word": m & (targets > head),
        "structure": m & (targets < head),
    }
    total = float(np.abs(d[m]).sum()) or 1.0
    out = {}
    for name, k in kinds.items():
        n = int(k.sum())
        out[name] = {
            "share_tokens": n / max(int(m.sum()), 1),
            "mean_abs_d": float(np.abs(d[k]).mean()) if n else 0.0,
            "share_abs_d": float(np.abs(d[k]).sum()) / total,
            "frac_outside": float((log_rel[k] < LOG_RHO).mean()) if n else 0.0,
            "median_log_rel": float(np.median(log_rel[k])) if n else None,
        }
    return out


def measure(cfg, model, prompts: int, samples: int, keep_arrays: bool = False) -> dict:
    """The M3 sampler (cfg's rung, unpruned) on `model`'s weights over train prompts 0..prompts-1,
    `samples` each, scored by the fp32 trainer (`figures`); with `keep_arrays`, also the sampled
    tokens' log_rel and d for the plot. The sampler's key is e005_setup.SEED's, prompt p's
    folded in, so the same weights give the same draws (the control's points differ by the
    weights alone)."""
    from dvp_jax.train.batch import from_rollouts
    from experiments.e005_setup import chunk_examples
    from experiments.e005_setup import sample as draw

    t0 = time.time()
    examples, first = chunk_examples(cfg, 0, prompts)
    _, batch = draw(cfg, model, examples, first, -math.inf, samples)
    rl = from_rollouts(batch, np.zeros(batch.num_rows, np.float32))
    st = trainer_scores(cfg, model, rl)
    mask = np.asarray(rl.response_mask)
    d = np.where(mask, np.asarray(rl.behaviour_logp_full) - st["logp_full"], 0.0)
    out = figures(d, st["log_rel"], st["entropy"], mask)
    out["by_kind"] = by_kind(cfg, np.asarray(rl.tokens)[:, 1:], d, st["log_rel"], mask)
    # The policy's own mass outside its safe set, per response position (not only the sampled
    # token): what the outside share estimates, without the sampling noise.
    out["mass_outside_safe"] = float(st["pruned_mass"][mask].mean())
    out["responses"] = int(batch.num_rows)
    out["mean_length"] = float(mask.sum(1).mean())
    out["seconds"] = round(time.time() - t0, 1)
    if keep_arrays:
        out["_arrays"] = {"log_rel": st["log_rel"][mask], "d": d[mask]}
    return out


def plot_gate(arrays: dict, fig_: dict, path: str) -> None:
    """The sampled tokens' log pi(y)/max pi (count and |d|-weighted), the safe set's edge."""
    from experiments.analyze import pyplot

    plt = pyplot()
    lr, d = arrays["log_rel"], np.abs(arrays["d"])
    bins = np.linspace(min(-20.0, float(lr.min()) - 0.5), 0.5, 60)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].hist(lr, bins=bins, color="tab:blue")
    axes[0].set(yscale="log", title="sampled tokens (M3 sampler, unpruned)", ylabel="tokens")
    axes[1].hist(lr, bins=bins, weights=d, color="tab:red")
    axes[1].set(title="|log mu - log pi| carried", ylabel="sum |d| (nats)")
    for ax in axes:
        ax.axvline(LOG_RHO, color="k", ls="--", lw=1, label="safe set edge, e^-13")
        ax.set_xlabel("log pi(y) - log max pi (fp32 trainer)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"e007 gate: {fig_['outside_share']:.1%} of sampled tokens outside the safe set, "
        f"{fig_['tail_abs_share']:.1%} of sum |d| (gate: >= {rules.GATE_MIN_OUTSIDE:.0%}, "
        f">= {rules.GATE_MIN_TAIL_SHARE:.0%})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def gate(init_hf: str, smoke: bool = False) -> tuple[dict, dict]:
    """The gate's record (figures, sizes, status, code version) and the plot's arrays."""
    cfg = config("rloo", rules.RUNG, smoke)
    model = policy(cfg, init_hf)
    prompts, samples = (2, 2) if smoke else (rules.GATE_PROMPTS, rules.GATE_SAMPLES)
    fig_ = measure(cfg, model, prompts, samples, keep_arrays=True)
    arrays = fig_.pop("_arrays")
    task = cfg.data.make_task()
    rec = {
        **fig_,
        "status": rules.gate_status(fig_),
        "thresholds": {
            "outside_share": rules.GATE_MIN_OUTSIDE,
            "tail_abs_share": rules.GATE_MIN_TAIL_SHARE,
        },
        "rung": rules.RUNG,
        "rollout_dtype": cfg.rollout.dtype,
        "init_hf": init_hf or "random init (smoke)",
        "weights_sha256": weights_hash(init_hf),
        "task": {"name": cfg.data.task, **cfg.data.tail_sum, "free_share": task.free_share()},
        "vocab_size": cfg.model.vocab_size,
        "code_version": code_version(),
    }
    return rec, arrays


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--init_hf", default="/tmp/e007/root/e007_tail/_warm/hf_export", help="the warm start"
    )
    p.add_argument("--out", default="", help=f"default {OUT}; with --smoke required elsewhere")
    p.add_argument("--smoke", action="store_true", help="CI sizes on a random init")
    args = p.parse_args(argv)
    out = args.out or (OUT if not args.smoke else "")
    if args.smoke and (not out or os.path.abspath(out) == os.path.join(REPO, OUT)):
        p.error(f"--smoke measures a random model: give an --out other than {OUT}")
    rec, arrays = gate("" if args.smoke else args.init_hf, args.smoke)
    os.makedirs(out, exist_ok=True)
    write_atomic(os.path.join(out, "gate.json"), json.dumps(rec, indent=1))
    plot_gate(arrays, rec, os.path.join(out, "e007_gate.png"))
    keys = ("status", "outside_share", "tail_abs_share", rules.PRIMARY, "entropy", "seconds")
    print(json.dumps({k: rec[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
