"""e004 stage 1: the warm start sampled at each mismatch level, scored by the trainer's functions.

`measure(hf_dir, level)` samples responses from an exported policy with the rollout engine at a
level (configs/e004_running_sum.py: the ladder `LEVELS` M0-M3, or the synthetic rung M4 of
`SYNTHETIC`, M3 plus tail-shaped logit noise) and returns the trainer's teacher-forced
statistics of them (`train.step.token_stats`, `dvp.diagnostics.tail_metrics`): response length,
truncation, reward, entropy, E[L], the share of E[L] from outside the e^-13 safe set. Run through
experiments/e004_running_sum.py (`--stage 1`), which writes results/e004/stage1_levels.json.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import numpy as np

from dvp_jax.launch import sweep
from experiments import e004_verdict as gates

CONFIG = "configs/e004_running_sum.py"
LOG_RHO = -13.0  # the trainer's safe set of the tail statistics (LossConfig default)


def config_module():
    from dvp_jax.pyfile import load_file

    return load_file(os.path.join(sweep.REPO, CONFIG))


def level_config(level: str, overrides: dict | None = None):
    """The validated `ExperimentConfig` of the e004 config at `level` (plus dotted overrides)."""
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    cd = config_module().get_config(f"rloo:{level}")
    cd.lock()
    cd.update_from_flattened_dict(overrides or {})
    # A unit's warm start need not exist yet (a sweep checked before stage 0 runs).
    return ExperimentConfig.from_config_dict(
        cd, load_tokenizer(cd.data.tokenizer).vocab_size, read_checkpoint=False
    )


def measure(
    hf_dir: str,
    level: str,
    num_prompts: int = 64,
    samples: int = 16,
    seed: int = 0,
    overrides: dict | None = None,
    rows_per_pass: int = 64,
) -> dict:
    """Samples `num_prompts` x `samples` responses from the policy in `hf_dir` at `level` and
    returns the trainer's teacher-forced statistics of them.

    The rollout is RLOO's (unpruned, temperature 1, `max_decode_length` of the config); the same
    train prompts (train examples 0..num_prompts-1 of stream 0) and keys at every level. The
    engine fake-quantizes the M2 / M3 kernels itself when it takes the weights, so it samples
    from (and records log mu of) exactly the quantized model.
    Statistics: `token_stats` at log_rho = LOG_RHO on the fp32 trainer (the trainer's safe set
    and entropy), then `diagnostics.tail_metrics` on all responses at once.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dvp_jax.data import rewards
    from dvp_jax.dvp import diagnostics
    from dvp_jax.model import TRAIN_POLICY
    from dvp_jax.model.config import DTypePolicy
    from dvp_jax.model.hf_import import load_hf
    from dvp_jax.rollout.engine import RolloutEngine
    from dvp_jax.rollout.offline import generate_rollouts
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train import evaluation
    from dvp_jax.train.batch import from_rollouts
    from dvp_jax.train.build import engine_config

    t0 = time.time()
    cfg = level_config(level, overrides)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = load_hf(hf_dir, TRAIN_POLICY, cfg=cfg.model)
    params = nnx.state(model, nnx.Param)
    policy = DTypePolicy.named(cfg.rollout.dtype)
    # The level's rollout section (dtype; M4's tail-shaped noise) as the run would take it.
    engine = RolloutEngine(
        cfg.model,
        dataclasses.replace(
            engine_config(cfg),
            max_concurrent_decodes=rows_per_pass,
            prefill_buckets=(cfg.data.max_prompt_len,),
            log_rho=-math.inf,  # RLOO's rollout: the whole vocabulary
            seed=seed,
        ),
        tokenizer=tokenizer,
        params=params,
    )
    task = cfg.data.make_task()
    examples = task.train_examples(num_prompts)
    batch = generate_rollouts(
        engine,
        [ex.prompt for ex in examples],
        samples,
        jax.random.key(seed),
        prompt_len=cfg.data.max_prompt_len,
    )
    t_sample = time.time() - t0
    texts = evaluation.response_texts(tokenizer, batch)
    answers = [ex.answer for ex in examples for _ in range(samples)]
    reward = rewards.compute_rewards(cfg.data.reward_spec, texts, answers)

    rl = from_rollouts(batch, np.zeros(batch.num_rows, np.float32))
    a = trainer_token_stats(cfg, model, rl, rows_per_pass)
    tail = diagnostics.tail_metrics(
        logp=jnp.asarray(a["logp"]),
        behaviour_logp=jnp.asarray(rl.behaviour_logp),
        logp_full=jnp.asarray(a["logp_full"]),
        behaviour_logp_full=jnp.asarray(rl.behaviour_logp_full),
        response_mask=jnp.asarray(rl.response_mask),
        safe=jnp.asarray(a["in_safe"]),
        # E5 membership: seq_log_ratio_pruned is then over the responses DVP would keep (no
        # token outside the trainer's safe set), against the unpruned rollout's log mu.
        in_safe=jnp.asarray(a["in_safe"]),
        entropy=jnp.asarray(a["entropy"]),
    )
    # Per-response L (unpruned) for its spread, on the same arrays tail_metrics summed.
    mask = rl.response_mask
    l_tok = np.where(mask, a["logp_full"] - rl.behaviour_logp_full, 0.0)
    l_seq = l_tok.sum(-1)
    outside = mask & ~a["in_safe"]
    lengths = batch.response_mask.sum(-1)
    stop = set(engine.stop_tokens)
    finished = np.array(
        [
            bool(len(r)) and int(r[-1]) in stop
            for r in (batch.response(i) for i in range(len(lengths)))
        ]
    )
    return {
        "level": level,
        "rollout_dtype": cfg.rollout.dtype,
        "noise_std": cfg.rollout.noise_std,
        "noise_tail_gap": cfg.rollout.noise_tail_gap,
        "weights_quantized_by": "the engine" if policy.weight_quant != "none" else "none",
        "responses": int(batch.num_rows),
        "prompts": num_prompts,
        "samples_per_prompt": samples,
        "response_length": float(lengths.mean()),
        "response_length_p5_p95": [float(v) for v in np.percentile(lengths, [5, 95])],
        "truncation_rate": float(1 - finished.mean()),
        "reward_mean": float(reward.mean()),
        **{k: float(v) for k, v in tail.items()},
        "seq_log_ratio_se": float(l_seq.std(ddof=1) / math.sqrt(len(l_seq))),
        "seq_log_ratio_abs_mean": float(np.abs(l_seq).mean()),
        "frac_tokens_outside_safe": float(outside.sum() / max(mask.sum(), 1)),
        "frac_responses_with_outside_token": float(outside.any(-1).mean()),
        "mean_l_outside_token": float(l_tok[outside].mean()) if outside.any() else 0.0,
        "mean_l_inside_token": float(l_tok[mask & a["in_safe"]].mean()),
        "log_rho": LOG_RHO,
        "seconds": round(time.time() - t0, 1),
        "sample_seconds": round(t_sample, 1),
    }


def measure_missing(path: str, head: dict, section: str, todo, num_prompts: int, samples: int):
    """`measure` of each (key, level, overrides) of `todo` not yet under `section` of the JSON at
    `path` (created with `head`), written after each; the warm start is `head["init_hf"]`."""
    import json

    data = {**head, section: {}}
    if os.path.exists(path):
        with open(path) as fh:
            data = json.load(fh)
    for key, level, overrides in todo:
        have = data[section].get(key)
        if have and have["responses"] == num_prompts * samples:
            print(f"[e004 stage 1] {key}: done ({path})", flush=True)
            continue
        print(f"[e004 stage 1] measuring {key} ({num_prompts} x {samples})", flush=True)
        rec = measure(head["init_hf"], level, num_prompts, samples, overrides=overrides)
        data[section][key] = rec
        print(json.dumps(rec), flush=True)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=1)
    return data


def trainer_token_stats(cfg, model, rl, rows: int = 64) -> dict:
    """The fp32 trainer's `token_stats` at log rho = LOG_RHO over an `RLBatch`, `rows` at a
    time: the `TokenLogprobs` fields and the entropy, each [N, T-1] (NumPy)."""
    import jax
    from flax import nnx

    from dvp_jax.train.step import token_stats

    graphdef, params = nnx.split(model, nnx.Param)
    fn = functools.partial(
        token_stats,
        graphdef=graphdef,
        log_rho=LOG_RHO,
        temperature=cfg.loss.temperature,
        chunk_size=cfg.train.chunk_size,
    )
    fn = jax.jit(fn)
    parts = {}
    for s in range(0, rl.tokens.shape[0], rows):
        sl = slice(s, s + rows)
        tl, st = fn(
            params, tokens=rl.tokens[sl], positions=rl.positions[sl], segment_ids=rl.valid[sl]
        )
        for k, x in (*tl._asdict().items(), ("entropy", st.entropy)):
            parts.setdefault(k, []).append(np.asarray(x))
    return {k: np.concatenate(v) for k, v in parts.items()}


def plot_levels(levels: dict, path: str) -> None:
    """Bar charts of the stage-1 figures per level, with the power thresholds."""
    from experiments.analyze import pyplot

    plt = pyplot()
    names = [lv for lv in gates.LEVEL_ORDER if lv in levels]
    panels = [
        ("response_length", gates.MIN_LENGTH),
        ("entropy", gates.MIN_ENTROPY),
        ("seq_log_ratio", -gates.MIN_ABS_SEQ_LOG_RATIO),
        ("seq_log_ratio_outside_share", gates.MIN_OUTSIDE_SHARE),
        ("frac_tokens_outside_safe", None),
        ("reward_mean", None),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (key, thr) in zip(axes, panels, strict=True):
        ax.bar(names, [levels[n][key] for n in names])
        if thr is not None:
            ax.axhline(thr, color="r", ls="--", lw=1)
        ax.set_title(key, fontsize=9)
    fig.suptitle("e004 stage 1: warm start sampled at each level (red: power threshold)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_units(records: list[dict], path: str) -> None:
    """Per-step curves of every unit (reward, entropy, log PPL diff, grad norm, E[L])."""
    from experiments.analyze import pyplot

    plt = pyplot()
    keys = (
        "reward_mean",
        "entropy",
        "log_ppl_diff",
        "grad_norm",
        "seq_log_ratio",
        "response_length",
    )
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, key in zip(axes.flat, keys, strict=True):
        for r in records:
            ys = r["curves"][key]
            ax.plot(range(1, len(ys) + 1), ys, label=f"{r['method']} {r['level']} s{r['seed']}")
        ax.set(title=key, xlabel="RL step")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
