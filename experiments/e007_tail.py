"""e007: DVP where the tail carries mass (gated, pre-registered, paired by seed; issue 46).

e006 found DVP with nothing to act on: 0.0012% of its sampled tokens outside the trainer's e^-13
safe set. e007 runs e006's arms on the tail-sum task (configs/e007_tail_sum.py: free positions
with a 0.9 head and a 0.1 tail over ~100k words, each tail word below e^-13 x p_max), after a
gate on the warm start (experiments/e007_gate.py: >= 5% of RLOO's sampled tokens outside the
safe set, the tail carrying >= 30% of |log mu - log pi| at M3). The rules, the gate, the null
outcomes and the seed count are experiments/e007_verdict.py (committed with this file, before any
arm data).

CPU tier (this file): from the warm start (`--warm` makes it: `WARM_SFT_STEPS` supervised steps,
deterministic, exported to <root>/e007_tail/_warm/hf_export; not committed, its safetensors hash
is in gate.json), arms `rules.ARMS` x `rules.SEEDS`, `rules.STEPS` RL steps each, every run in
`UNIT_STEPS`-step segments (one segment = one unit, resumable). The premise arms (RLOO fp32,
RLOO M3) of every seed first, then DVP and MIS+DVP, then IcePop. After each rloo_fp32 segment
(and once at step 0, on the warm start) the weight-drift control measures the M3 sampler on the
fp32 arm's weights (`e007_gate.measure`); it goes into that run's record as `control`. After each
unit, results/e007/units/<run>.json and verdict.json are rewritten.

Commands (repository root; `--lane i/n` runs every n-th run from the i-th, as e006):
  python -m experiments.e007_tail --warm --root /tmp/e007/root          (the warm start)
  python -m experiments.e007_gate --init_hf /tmp/e007/root/e007_tail/_warm/hf_export
  python -m experiments.e007_tail --root /tmp/e007/root [--max_units N] [--status] [--lane i/n]
  python -m experiments.e007_tail --smoke --root /tmp/e007_smoke   (CI sizes, random init;
      records and verdict under <root>/results)
Hardware, step times and the budget: experiments/README.md, e007.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dvp_jax.launch import local
from dvp_jax.launch import sweep as sweeps
from dvp_jax.workdir import write_atomic
from experiments import e007_gate as gate_lib
from experiments import e007_verdict as rules
from experiments import records
from experiments.provenance import code_version
from experiments.records import run_name
from experiments.records import write_unit as write_record

CONFIG = "configs/e007_tail_sum.py"
CONFIG_ARG = "rloo:M3"
SUMMARY_KEYS = ("start_eval_accuracy", "eval_accuracy", "wall_time_s")
EXPERIMENT = "e007_tail"
OUT = "experiments/results/e007"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = rules.ARMS
UNIT_STEPS = 20
WARM_SFT_STEPS = 600  # configs/e007_tail_sum.py SFT_STEPS
CONTROL_PROMPTS, CONTROL_SAMPLES = rules.GATE_PROMPTS, rules.GATE_SAMPLES
LEVELS = {"M0": "float32", "M3": "bfloat16_fp8kv_int4w"}  # configs/e007_tail_sum.py LEVELS
SIZES = {  # on top of the e007 config (8 prompts x 8 responses of 58 tokens per RL step)
    "eval.every": 0,
    "eval.num_prompts": 32,
    "eval.k": 8,
    "checkpoint.every": 10,
    "plots": False,
}
SMOKE = {  # CI sizes: a random model, 2 RL steps, 2 prompts x 2 responses
    "sft.steps": 0,
    "train.prompts_per_step": 2,
    "train.group_size": 2,
    "eval.num_prompts": 2,
    "eval.k": 2,
    "eval.every": 0,
    "eval.dtype": "",
    "checkpoint.every": 0,
    "plots": False,
    **gate_lib.SMOKE,
}
# The per-step series each run record keeps (declared trainer metrics, dvp_jax/metrics.py).
CURVES = (
    "full_kl_k1",
    "full_kl_k1_inside",
    "full_kl_k1_outside",
    "full_log_ppl_diff",
    "frac_tokens_outside_safe",
    "abs_log_ratio_outside_share",
    "entropy",
    "reward_mean",
    "response_length",
    "frac_responses_excluded",
    "frac_responses_masked",
    "frac_tokens_masked",
    "frac_tokens_outside_train_safe",
    "grad_norm",
)


def unit_order(seeds=rules.SEEDS, steps: int = rules.STEPS, unit_steps: int = UNIT_STEPS):
    """Every (arm, seed, segment end) in run order: the premise arms of every seed first, then
    DVP and MIS+DVP, then IcePop; a run's segments one after another."""
    return records.unit_order(rules.ARM_GROUPS, seeds, steps, unit_steps)


def lane_runs(lane: str, seeds=rules.SEEDS) -> set[str]:
    """The runs of lane "i/n" (`records.lane_runs`)."""
    return records.lane_runs(lane, unit_order(seeds))


def arm_overrides(arm: str, seed: int, steps: int, init_hf: str, smoke: bool = False) -> dict:
    method, rung = ARMS[arm]
    start = {"model.hf_path": os.path.abspath(init_hf), "sft.steps": 0} if init_hf else {}
    return {
        "_name": run_name(arm, seed),
        "method": method,
        "rollout.dtype": LEVELS[rung],
        "train.seed": seed,
        "data.seed": seed,
        "train.steps": steps,
        **(SMOKE if smoke else SIZES),
        **start,
    }


def get_sweep(
    steps: int = rules.STEPS, init_hf: str = "", arms: str = "", seeds: int = rules.N_SEEDS,
    smoke: bool = False, arm: str = "rloo_fp32",
) -> list[dict]:  # fmt: skip
    """Every run (`arms`: comma-separated names of `ARMS`, default all; `seeds`: the first n).
    `smoke`: one run of `arm` at the CI sizes from a random init."""
    if smoke:
        return [arm_overrides(arm, 0, steps, init_hf, smoke=True)]
    names = [a for a in arms.split(",") if a] or list(ARMS)
    return [arm_overrides(a, s, steps, init_hf) for s in rules.SEEDS[:seeds] for a in names]


def warm_dir(root: str) -> str:
    return os.path.join(os.path.abspath(root), EXPERIMENT, "_warm")


def make_warm_start(root: str) -> str:
    """The warm start's hf_export (made once: `WARM_SFT_STEPS` SFT steps, no RL)."""
    warm = warm_dir(root)
    export = os.path.join(warm, "hf_export")
    if not os.path.exists(os.path.join(export, "config.json")):
        over = {"train.steps": 0, "sft.steps": WARM_SFT_STEPS}
        argv = sweeps.unit_argv(f"{CONFIG}:{CONFIG_ARG}", over.items(), warm, sys.executable)
        if local.run_logged(argv, warm):
            raise SystemExit(f"[e007] the warm start failed; see {warm}/launch.log")
    return export


# ------------------------------------------------------------------------------------------------
# Records.
# ------------------------------------------------------------------------------------------------
def run_record(workdir: str, arm: str, seed: int, seconds: list, evals_before=(), control=()):
    """The curves, held-out evaluations and (fp32 arm) control points of one run so far (None
    before its first segment). Earlier evaluations are kept (a resumed segment drops the rows
    after its checkpoint from metrics.jsonl)."""
    from dvp_jax import metrics

    summary = local.read_summary(workdir)
    if summary is None:
        return None
    rows = metrics.read_metrics(workdir)
    train = sorted({int(r["step"]): r for r in rows if r["step"] > 0 and "loss" in r}.items())
    train = [r for _, r in train]
    evals = {int(st): float(a) for st, a in evals_before}
    evals |= {int(r["step"]): float(r["eval_accuracy"]) for r in rows if "eval_accuracy" in r}
    method, rung = ARMS[arm]
    return {
        "run": run_name(arm, seed),
        "arm": arm,
        "method": method,
        "rung": rung,
        "seed": seed,
        "steps": int(summary["steps"]),
        "evals": [list(e) for e in sorted(evals.items())],
        "steps_logged": [int(r["step"]) for r in train],
        "curves": {k: [float(r[k]) if k in r else None for r in train] for k in CURVES},
        "control": sorted(control, key=lambda c: c["step"]),
        "segment_seconds": seconds,
        "code_version": code_version(),
    }


def workdir_of(root: str, arm: str, seed: int) -> str:
    return os.path.join(os.path.abspath(root), EXPERIMENT, run_name(arm, seed))


def reached(root: str, arm: str, seed: int) -> int:
    summary = local.read_summary(workdir_of(root, arm, seed))
    return int(summary["steps"]) if summary else 0


def recorded(out: str, arm: str, seed: int) -> dict | None:
    path = os.path.join(out, "units", f"{run_name(arm, seed)}.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def pending(order, root: str, out: str) -> list:
    """The units of `order` still to run: a run is as far as its workdir, or done when its record
    is complete (the record is the result; the workdir only resumes it)."""
    last = {}
    for a, s, e in order:
        last[(a, s)] = max(e, last.get((a, s), 0))
    done = {}
    for (a, s), end in last.items():
        done[(a, s)] = reached(root, a, s)
        rec = recorded(out, a, s)
        if not done[(a, s)] and rec and rec["steps"] >= end:
            done[(a, s)] = rec["steps"]
    return [(a, s, e) for a, s, e in order if done[(a, s)] < e]


def control_point(export: str, step: int, smoke: bool = False) -> dict:
    """The weight-drift control at `step`: the M3 sampler on the weights of `export`."""
    cfg = gate_lib.config("rloo", rules.RUNG, smoke)
    model = gate_lib.policy(cfg, export)
    prompts, samples = (2, 2) if smoke else (CONTROL_PROMPTS, CONTROL_SAMPLES)
    return {"step": step, **gate_lib.measure(cfg, model, prompts, samples)}


def start_control(root: str, init_hf: str, smoke: bool) -> dict:
    """The control at step 0 (the warm start's weights, the same for every seed), cached."""
    path = os.path.join(os.path.abspath(root), EXPERIMENT, "control_step0.json")
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    point = control_point(init_hf, 0, smoke)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps(point))
    return point


def run_segment(root: str, out: str, arm: str, seed: int, end: int, init_hf: str, smoke=False):
    """Launches one segment (the run resumed to step `end`), then the control on the fp32 arm,
    and rewrites its record."""
    path = os.path.join(REPO, "experiments", f"{EXPERIMENT}.py")
    sweep = {"steps": end, "init_hf": init_hf, "smoke": smoke}
    sweep |= {"arm": arm} if smoke else {"arms": arm, "seeds": seed + 1}
    exp = sweeps.load_experiment(path, sweep)
    unit = next(u for u in exp.units if u.name.split("_", 1)[1] == run_name(arm, seed))
    workdir = workdir_of(root, arm, seed)
    at = reached(root, arm, seed)
    before = recorded(out, arm, seed) if at else None  # a rerun from step 0 starts clean
    evals = [e for e in (before or {}).get("evals", []) if e[0] <= at]
    control = [c for c in (before or {}).get("control", []) if c["step"] <= at]
    seconds = (before or {}).get("segment_seconds", []) if before and before["steps"] <= at else []
    t0 = time.time()
    result = local.run_unit(exp, unit, workdir, None)
    if result.ok and arm == "rloo_fp32":
        if not any(c["step"] == 0 for c in control):
            control.append(start_control(root, init_hf, smoke))
        control.append(control_point(os.path.join(workdir, "hf_export"), end, smoke))
    rec = run_record(workdir, arm, seed, seconds + [round(time.time() - t0, 1)], evals, control)
    if rec is not None:
        write_record(out, rec)
    return result, rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="/tmp/e007/root", help="the runs' workdirs (not committed)")
    p.add_argument("--out", default="", help=f"default {OUT}; with --smoke <root>/results")
    p.add_argument("--init_hf", default="", help="the warm start (default: <root>'s --warm)")
    p.add_argument("--warm", action="store_true", help="make the warm start and stop")
    p.add_argument("--max_units", type=int, default=0, help="stop after this many (0: all)")
    p.add_argument("--status", action="store_true", help="print which units are missing")
    p.add_argument("--lane", default="", help="i/n: only every n-th run from the i-th")
    p.add_argument("--smoke", action="store_true", help="CI sizes on a random init")
    args = p.parse_args(argv)
    if args.warm:
        print(f"[e007] warm start: {make_warm_start(args.root)}", flush=True)
        return 0
    if args.smoke:
        args.out = args.out or os.path.join(args.root, "results")
        if os.path.abspath(args.out) == os.path.join(REPO, OUT):
            p.error(f"--smoke writes a random model's records: give an --out other than {OUT}")
        order, init_hf = [("rloo_fp32", 0, 2)], ""
    else:
        args.out = args.out or OUT
        order = unit_order()
        init_hf = args.init_hf or os.path.join(warm_dir(args.root), "hf_export")
        gate = rules.load_gate(args.out)
        if rules.gate_status(gate) != "passes" and not args.status:
            raise SystemExit(f"[e007] the gate has not passed ({args.out}/gate.json): no arm runs")
    if args.lane and not args.smoke:
        mine = lane_runs(args.lane)
        order = [(a, s, e) for a, s, e in order if run_name(a, s) in mine]
    todo = pending(order, args.root, args.out)
    if args.status:
        lane = f" (lane {args.lane})" if args.lane else ""
        print(f"e007{lane}: {len(order) - len(todo)} of {len(order)} units done; next: {todo[:3]}")
        return 0
    for i, (arm, seed, end) in enumerate(todo):
        if args.max_units and i >= args.max_units:
            break
        result, _ = run_segment(args.root, args.out, arm, seed, end, init_hf, args.smoke)
        status = "ok" if result.ok else f"FAILED (exit {result.returncode})"
        print(
            f"[e007] {run_name(arm, seed)} to step {end}: {status} in {result.wall_s:.0f} s, "
            f"held-out {(result.summary or {}).get('eval_accuracy')}",
            flush=True,
        )
        if not result.ok:
            print(f"[e007] see {result.workdir}/launch.log; rerun to resume", flush=True)
            return 1
    rules.main(["--out", args.out] + (["--smoke"] if args.smoke else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
