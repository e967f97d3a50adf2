"""e006, device tier: the same arms at a size where the tail exists, in <= 10 minutes on one H200.

At the CPU tier's size (a ~7k vocabulary, ~175-token responses, 1.19M parameters) the tokens
outside the e^-13 safe set are ~0.08% of those sampled (e005), so the paper's tail can hardly
act. Here the running-sum task of configs/e004_running_sum.py is scaled (`DEVICE`): 32,000
thought words (a ~32k vocabulary) with a Zipf exponent whose last rank lies 13.1 nats below the
first (`TAIL_EXPONENT`: the tail reaches past the e^-13 safe set, as the e004 design intends),
responses of 960-1,020 tokens, a 4-layer d_model 256 decoder (~11.6M parameters, 8.2M of them
the tied embedding). Nothing is downloaded: the tokenizer and the task are generated, and the
warm start is trained on the device (`WARM_SFT_STEPS` supervised steps, exported once). Then
every arm of e006 (`e006_verdict.ARMS`) x `--seeds` runs for `--steps` RL steps through the
launcher, as the CPU tier's runs do (one process each; the compilation cache shares programs of
equal shapes), writing results/e006_device/units/<run>.json in the CPU tier's record format
and verdict.json by the same rules (at the device's steps and seeds). A wall-clock guard
(`--budget_s`, default 570) starts no run whose estimated time (the slowest run so far) would pass
it; the runs left out are listed. Sizes and times are estimates until measured on the device:
the first device session should run `--seeds 1 --steps 10` and record the times. The rules need
two seeds at least for an interval (`--seeds 1` gives each arm's figures, the verdict
"incomplete"), hence the default 2; with the guard the premise arms of both seeds run first.

The tail that exists here is thin: the thought words' own Zipf puts 0.09% of its mass below
e^-13 of its top word (`smoke()`'s `data_mass_outside_safe`), the order of the CPU tier's 0.08%
of sampled tokens outside the safe set (e005). What the model's samples carry is recorded per
step (`frac_tokens_outside_train_safe`); a task whose positions are peaked with a flat tail
(one likely word, the rest spread over the vocabulary) would be needed for a material share.

Commands (repository root):
  python -m experiments.e006_device --root /tmp/e006_device [--seeds 2] [--steps 30]
  python -m experiments.e006_device --smoke   (CPU, seconds: every unit's config validated at
      the device sizes and the model's parameters counted under `nnx.eval_shape`; nothing runs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from dvp_jax.dvp.pruning import DEFAULT_LOG_RHO
from dvp_jax.launch import local
from dvp_jax.launch import sweep as sweeps
from experiments import e006_premise as cpu
from experiments import e006_verdict as rules

CONFIG = cpu.CONFIG
CONFIG_ARG = cpu.CONFIG_ARG
EXPERIMENT = "e006_device"
OUT = "experiments/results/e006_device"
THOUGHT_WORDS = 32_000
TAIL_EXPONENT = 1.26  # ln(p_last / p_first) = -1.26 ln(32,000) = -13.07 nats
WARM_SFT_STEPS = 300
DEVICE = {
    "data.tokenizer": f"running_sum:{THOUGHT_WORDS}",
    "data.running_sum.n_words": THOUGHT_WORDS,
    "data.running_sum.zipf_exponent": TAIL_EXPONENT,
    "data.running_sum.min_response_len": 960,
    "data.running_sum.max_response_len": 1020,
    "rollout.max_decode_length": 1022,
    "model.max_position_embeddings": 1032,
    "model.d_model": 256,
    "model.n_layers": 4,
    "model.n_heads": 8,
    "model.n_kv_heads": 4,
    "model.head_dim": 32,
    "model.d_ff": 768,
    "train.learning_rate": 2e-4,
    "eval.every": 0,
    "eval.num_prompts": 39,
    "eval.k": 16,
    "checkpoint.every": 0,
    "plots": False,
}


def arm_overrides(arm: str, seed: int, steps: int, init_hf: str) -> dict:
    method, rung = rules.ARMS[arm]
    return {
        "_name": cpu.run_name(arm, seed),
        "method": method,
        "rollout.dtype": cpu.LEVELS[rung],
        "train.seed": seed,
        "data.seed": seed,
        "train.steps": steps,
        **DEVICE,
        "model.hf_path": os.path.abspath(init_hf) if init_hf else "",
        "sft.steps": 0 if init_hf else WARM_SFT_STEPS,
    }


def get_sweep(steps: int = 30, init_hf: str = "", seeds: int = 1) -> list[dict]:
    """Every run: the arms of every seed in the CPU tier's order (premise arms first)."""
    return [
        arm_overrides(arm, s, steps, init_hf)
        for group in rules.ARM_GROUPS
        for s in rules.SEEDS[:seeds]
        for arm in group
    ]


def warm_overrides() -> dict:
    return {**DEVICE, "train.steps": 0, "sft.steps": WARM_SFT_STEPS}


def smoke() -> dict:
    """Every unit's config at the device sizes, validated; the model counted abstractly."""
    import jax
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, Transformer
    from dvp_jax.pyfile import load_file
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    module = load_file(os.path.join(cpu.REPO, CONFIG))
    units = [warm_overrides()] + get_sweep(init_hf="", seeds=len(rules.SEEDS))
    vocab, cfgs = None, []
    for u in units:
        cd = module.get_config(f"{u.get('method', 'rloo')}:M0")
        cd.update_from_flattened_dict({k: v for k, v in u.items() if k not in ("_name", "method")})
        vocab = vocab or load_tokenizer(cd.data.tokenizer).vocab_size
        cfgs.append(ExperimentConfig.from_config_dict(cd, vocab))
    abstract = nnx.eval_shape(lambda: Transformer(cfgs[0].model, TRAIN_POLICY, rngs=nnx.Rngs(0)))
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    tail = -TAIL_EXPONENT * math.log(THOUGHT_WORDS)
    weights = [r**-TAIL_EXPONENT for r in range(1, THOUGHT_WORDS + 1)]
    beyond = sum(w for w in weights if math.log(w) < DEFAULT_LOG_RHO)  # the safe set's edge
    return {
        "units": len(units),
        "methods": sorted({c.method for c in cfgs}),
        "vocab_size": cfgs[0].model.vocab_size,
        "params": int(params),
        "max_decode_length": cfgs[0].rollout.max_decode_length,
        "tail_log_ratio_last_rank": tail,
        "data_mass_outside_safe": beyond / sum(weights),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="/tmp/e006_device", help="workdirs and the warm start")
    p.add_argument("--out", default=OUT)
    p.add_argument("--seeds", type=int, default=2, help="seeds per arm (>= 2 for a verdict)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--budget_s", type=float, default=570.0, help="no run starts past this")
    p.add_argument("--smoke", action="store_true", help="validate the configs only (CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        print(json.dumps(smoke()))
        return 0
    t0 = time.time()
    root = os.path.abspath(args.root)
    warm = os.path.join(root, EXPERIMENT, "_warm")
    export = os.path.join(warm, "hf_export")
    if not os.path.exists(os.path.join(export, "config.json")):
        argv_ = sweeps.unit_argv(
            f"{CONFIG}:{CONFIG_ARG}", warm_overrides().items(), warm, sys.executable
        )
        if local.run_logged(argv_, warm):
            print(f"[e006 device] the warm start failed; see {warm}/launch.log", flush=True)
            return 1
    print(f"[e006 device] warm start {time.time() - t0:.0f} s", flush=True)
    path = os.path.join(cpu.REPO, "experiments", f"{EXPERIMENT}.py")
    exp = sweeps.load_experiment(
        path, {"steps": args.steps, "init_hf": export, "seeds": args.seeds}
    )
    slowest, skipped = 0.0, []
    for unit in exp.units:
        if time.time() - t0 + slowest > args.budget_s:
            skipped.append(unit.name)
            continue
        arm, seed = unit.name.split("_", 1)[1].rsplit("_s", 1)
        workdir = os.path.join(root, EXPERIMENT, unit.name)
        start = time.time()
        result = local.run_unit(exp, unit, workdir, None)
        slowest = max(slowest, time.time() - start)
        rec = cpu.run_record(workdir, arm, int(seed), [round(time.time() - start, 1)])
        if rec is not None:
            cpu.write_record(args.out, rec)
        print(f"[e006 device] {unit.name}: {'ok' if result.ok else 'FAILED'} in "
              f"{time.time() - start:.0f} s", flush=True)  # fmt: skip
    units = rules.load_units(args.out)
    result = rules.verdict_from_units(units, steps=args.steps, seeds=rules.SEEDS[: args.seeds])
    result["skipped_for_time"] = skipped
    result["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "verdict.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(
        json.dumps({"premise": result["premise"], "skipped": skipped, "wall_s": result["wall_s"]})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
