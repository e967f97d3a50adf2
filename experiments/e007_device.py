"""e007, device tier: the same gate, arms and control on the tail-sum task at a device size, in
<= 10 minutes on one H100 or H200.

Sizes (`DEVICE`, on top of configs/e007_tail_sum.py): the tail-sum task scaled to what the CPU gate
showed it needs (experiments/README.md, e007 gate): 300,000 words (a ~301k vocabulary, each tail
word 14.8 nats below the head by the data's law, so a learned tail ~1 nat above it, as the CPU warm
start's was, still lies mostly outside the e^-13 safe set), 150 free words per step (responses of 2
x (4 + 150) + 2 = 310 tokens, 3.5% of them structure tokens, which carried 57% of sum |d| at the
CPU size), a 4-layer d_model 256 decoder (the tied embedding is 77M of its 80M parameters),
`WARM_SFT_STEPS` of batch 32 (each tail word seen ~2 times, as on the CPU). Nothing is downloaded:
the warm start is trained on the device, then the gate is measured on it exactly as the CPU tier's
(`e007_gate.measure`, GATE_PROMPTS x GATE_SAMPLES at M3, unpruned) and written to
results/e007_device/gate.json; only if it passes do the arms run (`e007_verdict.ARMS`, the premise
arms of every seed first), each `--steps` RL steps, with the weight-drift control measured on the
fp32 arm's weights at the end of its run (and at step 0). Records and verdict.json as the CPU
tier's, by the same rules at the device's steps and seeds. A wall-clock guard (`--budget_s`) starts
no run whose estimated time (the slowest so far) would pass it; the runs left out are listed. Times
are estimates until measured on a device: the first session should run `--seeds 2 --steps 20` and
record them.

Commands (repository root):
  python -m experiments.e007_device --root /tmp/e007_device [--seeds 3] [--steps 20]
  python -m experiments.e007_device --smoke   (CPU, seconds: every unit's config validated at the
      device sizes, the parameters counted under `nnx.eval_shape`, the task's law at that size
      put through the gate's thresholds; nothing trains)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from dvp_jax.launch import local
from dvp_jax.launch import sweep as sweeps
from dvp_jax.workdir import write_atomic
from experiments import e007_gate as gate_lib
from experiments import e007_tail as cpu
from experiments import e007_verdict as rules
from experiments.provenance import weights_hash

CONFIG = cpu.CONFIG
CONFIG_ARG = cpu.CONFIG_ARG
EXPERIMENT = "e007_device"
OUT = "experiments/results/e007_device"
THOUGHTS = 150
WORDS = 300_000
WARM_SFT_STEPS = 600  # ~4 min at an estimated 0.4 s per fp32 step (80M parameters, 10k tokens)
DEVICE = {
    "data.tokenizer": f"running_sum:{WORDS}",
    "data.tail_sum.n_words": WORDS,
    "data.tail_sum.thoughts_per_step": THOUGHTS,
    "rollout.max_decode_length": 2 * (4 + THOUGHTS) + 4,
    "model.max_position_embeddings": 2 * (4 + THOUGHTS) + 16,
    "model.d_model": 256,
    "model.n_layers": 4,
    "model.n_heads": 8,
    "model.n_kv_heads": 4,
    "model.head_dim": 32,
    "model.d_ff": 768,
    "sft.batch_size": 32,
    "train.prompts_per_step": 16,
    "train.group_size": 8,
    "eval.every": 0,
    "eval.num_prompts": 64,
    "eval.k": 8,
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


def get_sweep(steps: int = 20, init_hf: str = "", seeds: int = 2) -> list[dict]:
    """Every run: the arms of every seed in the CPU tier's order (premise arms first)."""
    return [
        arm_overrides(arm, s, steps, init_hf)
        for group in rules.ARM_GROUPS
        for s in rules.SEEDS[:seeds]
        for arm in group
    ]


def warm_overrides() -> dict:
    return {**DEVICE, "train.steps": 0, "sft.steps": WARM_SFT_STEPS}


def device_overrides() -> dict:
    """`DEVICE` as e007_gate.config overrides (model, task and decode sizes only)."""
    keep = ("data.", "model.", "rollout.")
    return {k: v for k, v in DEVICE.items() if k.startswith(keep)}


def smoke() -> dict:
    """Every unit's config at the device sizes, validated; the model counted abstractly; the
    task's own law at that size put through the gate (its free-word law alone, not a model)."""
    import jax
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, Transformer
    from dvp_jax.pyfile import load_file
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    module = load_file(os.path.join(cpu.REPO, CONFIG))
    units = [warm_overrides()] + get_sweep(init_hf="", seeds=3)
    vocab, cfgs = None, []
    for u in units:
        cd = module.get_config(f"{u.get('method', 'rloo')}:M3")
        cd.update_from_flattened_dict({k: v for k, v in u.items() if k not in ("_name", "method")})
        vocab = vocab or load_tokenizer(cd.data.tokenizer).vocab_size
        cfgs.append(ExperimentConfig.from_config_dict(cd, vocab))
    abstract = nnx.eval_shape(lambda: Transformer(cfgs[0].model, TRAIN_POLICY, rngs=nnx.Rngs(0)))
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    task = cfgs[0].data.make_task()
    p = task.word_probs()
    beyond = float(p[np.log(p / p.max()) < gate_lib.LOG_RHO].sum())
    data_gate = {"outside_share": beyond * task.free_share(), "tail_abs_share": 1.0}
    return {
        "units": len(units),
        "methods": sorted({c.method for c in cfgs}),
        "vocab_size": cfgs[0].model.vocab_size,
        "params": int(params),
        "response_tokens": task.max_response_len,
        "max_decode_length": cfgs[0].rollout.max_decode_length,
        "data_mass_outside_safe": beyond,
        "data_outside_share": data_gate["outside_share"],
        "data_gate_on_outside_share": rules.gate_status(data_gate),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="/tmp/e007_device", help="workdirs and the warm start")
    p.add_argument("--out", default=OUT)
    p.add_argument("--seeds", type=int, default=2, help="seeds per arm (>= 2 for an interval)")
    p.add_argument("--steps", type=int, default=20)
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
            print(f"[e007 device] the warm start failed; see {warm}/launch.log", flush=True)
            return 1
    print(f"[e007 device] warm start {time.time() - t0:.0f} s", flush=True)
    cfg = gate_lib.config("rloo", rules.RUNG, overrides=device_overrides())
    model = gate_lib.policy(cfg, export)
    gate = gate_lib.measure(cfg, model, rules.GATE_PROMPTS, rules.GATE_SAMPLES)
    gate |= {"status": rules.gate_status(gate), "weights_sha256": weights_hash(export)}
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "gate.json"), json.dumps(gate, indent=1))
    print(f"[e007 device] gate: {json.dumps(gate)}", flush=True)
    if gate["status"] != "passes":
        return 0
    path = os.path.join(cpu.REPO, "experiments", f"{EXPERIMENT}.py")
    exp = sweeps.load_experiment(
        path, {"steps": args.steps, "init_hf": export, "seeds": args.seeds}
    )
    start_ctrl = {"step": 0, **{k: gate[k] for k in gate if k != "status"}}
    slowest, skipped = 0.0, []
    for unit in exp.units:
        if time.time() - t0 + slowest > args.budget_s:
            skipped.append(unit.name)
            continue
        arm, seed = unit.name.split("_", 1)[1].rsplit("_s", 1)
        workdir = os.path.join(root, EXPERIMENT, unit.name)
        start = time.time()
        result = local.run_unit(exp, unit, workdir, None)
        control = []
        if result.ok and arm == "rloo_fp32":
            m = gate_lib.policy(cfg, os.path.join(workdir, "hf_export"))
            end = {"step": args.steps, **gate_lib.measure(cfg, m, rules.GATE_PROMPTS, 8)}
            control = [start_ctrl, end]
        slowest = max(slowest, time.time() - start)
        rec = cpu.run_record(
            workdir, arm, int(seed), [round(time.time() - start, 1)], control=control
        )
        if rec is not None:
            cpu.write_record(args.out, rec)
        print(f"[e007 device] {unit.name}: {'ok' if result.ok else 'FAILED'} in "
              f"{time.time() - start:.0f} s", flush=True)  # fmt: skip
    result = rules.verdict_from_units(
        rules.load_units(args.out), gate, steps=args.steps, seeds=rules.SEEDS[: args.seeds]
    )
    result["skipped_for_time"] = skipped
    result["wall_s"] = round(time.time() - t0, 1)
    write_atomic(os.path.join(args.out, "verdict.json"), json.dumps(result, indent=1))
    print(json.dumps({"status": result["status"], "skipped": skipped, "wall_s": result["wall_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
