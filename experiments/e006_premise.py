"""e006: the paper's premise first. Does a real rollout/trainer mismatch grow under plain RLOO?

Every positive result so far came from the synthetic rung M4 (900-2,600x the real rungs per
token; e004, e005). e006 asks the premise directly at a real rung: training plain RLOO on
rollouts from the M3 engine (bf16 + fp8 KV cache + int4 weights; configs/e004_running_sum.py),
does the per-step mismatch between the rollout's and the trainer's log-probs of the sampled
tokens grow, where RLOO on fp32 rollouts (M0) shows none? Only then: how much of that growth,
and of any held-out accuracy loss, does each method remove? The rules, the null outcome and the
thresholds are experiments/e006_verdict.py (committed with this file, before any data).

CPU tier (this file): from e005's warm start (experiments/results/e005/warm_start, 1,000 SFT
steps of the e004 config), arms (`ARMS`): RLOO at fp32 rollouts, RLOO, DVP, MIS+DVP and IcePop
at M3; seeds 0-2; `STEPS` RL steps each, every run launched in `UNIT_STEPS`-step segments that
resume it (one segment = one unit, <= ~15 minutes on one shared core). The premise arms (RLOO
fp32, RLOO M3) of every seed run first, then DVP and MIS+DVP, then IcePop (`unit_order`), so a
budget cut short leaves whole seeds of the premise. Per step every run logs (metrics.jsonl) the
mismatch of its sampled tokens, unpruned whatever the method: `full_kl_k1` = mean over response
tokens of log mu - log pi (primary) and `full_log_ppl_diff` = the paper's log-PPL gap (mean over
responses of the per-response mean); held-out avg@16 (39 problems x `EVAL_K`, an fp32 engine)
at steps 0 and at each segment's end. After each unit, results/e006/units/<run>.json (the
curves) and results/e006/verdict.json (the rules) are rewritten.

Commands (repository root; one unit at a time, resumable: what is done is skipped; `--lane i/n`
runs only every n-th run from the i-th, so n processes can share the units):
  python -m experiments.e006_premise --root /tmp/e006/root [--max_units N] [--status] [--lane i/n]
  python -m experiments.e006_premise --smoke --root /tmp/e006_smoke   (CI sizes, random init;
      its records and verdict go to <root>/results, never to the committed results folder)
Device tier: experiments/e006_device.py (the same arms at a size where the tail exists).
Hardware and times: experiments/README.md, e006.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dvp_jax.launch import local
from dvp_jax.launch import sweep as sweeps
from experiments import e005_setup, records
from experiments import e006_verdict as rules
from experiments.provenance import code_version
from experiments.records import run_name
from experiments.records import write_unit as write_record

CONFIG = "configs/e004_running_sum.py"
CONFIG_ARG = "rloo:M0"
SUMMARY_KEYS = ("start_eval_accuracy", "eval_accuracy", "wall_time_s")
EXPERIMENT = "e006_premise"
OUT = "experiments/results/e006"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM_START = os.path.join(REPO, "experiments", "results", "e005", "warm_start")
ARMS = rules.ARMS  # arm -> (method, rung); the verdict reads the same table
SEEDS = rules.SEEDS
STEPS = rules.STEPS
UNIT_STEPS = 25  # 22 s per step measured under load (one XLA thread, nice 10): <= ~10 min
EVAL_K = 16  # held-out samples per problem (39 problems: 624 responses per evaluation)
LEVELS = {"M0": "float32", "M3": "bfloat16_fp8kv_int4w"}  # configs/e004_running_sum.py LEVELS
SIZES = {  # on top of the e004 config (8 prompts x 16 responses per RL step, 1.19M parameters)
    "train.learning_rate": 2e-4,  # e004's RL units
    "eval.every": 0,
    "eval.num_prompts": 39,
    "eval.k": EVAL_K,
    "checkpoint.every": 10,
    "plots": False,
}
SMOKE = {  # CI sizes: a random model, 2 RL steps, 2 prompts x 2 responses of <= 17 tokens
    "sft.steps": 0,
    "train.prompts_per_step": 2,
    "train.group_size": 2,
    "eval.num_prompts": 2,
    "eval.k": 2,
    "eval.every": 0,
    "eval.dtype": "",
    "checkpoint.every": 0,
    "plots": False,
    **e005_setup.SMOKE,  # e005's CI model and response sizes
}
# The per-step series each run record keeps (declared trainer metrics, dvp_jax/metrics.py).
CURVES = (
    "full_kl_k1",
    "full_log_ppl_diff",
    "kl_k1",
    "reward_mean",
    "response_length",
    "frac_responses_excluded",
    "frac_responses_masked",
    "frac_tokens_masked",
    "frac_tokens_outside_train_safe",
    "grad_norm",
)


def unit_order(seeds=SEEDS, steps: int = STEPS, unit_steps: int = UNIT_STEPS):
    """Every (arm, seed, segment end) in run order: the premise arms of every seed first, then
    DVP and MIS+DVP, then IcePop; a run's segments one after another."""
    return records.unit_order(rules.ARM_GROUPS, seeds, steps, unit_steps)


def lane_runs(lane: str, seeds=SEEDS) -> set[str]:
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
    steps: int = STEPS, init_hf: str = WARM_START, arms: str = "", seeds: int = len(SEEDS),
    smoke: bool = False,
) -> list[dict]:  # fmt: skip
    """Every run (`arms`: comma-separated names of `ARMS`, default all; `seeds`: the first n),
    each `steps` long. `smoke`: one IcePop run at M3 at the CI sizes from a random init."""
    if smoke:
        return [arm_overrides("icepop_M3", 0, steps, init_hf, smoke=True)]
    names = [a for a in arms.split(",") if a] or list(ARMS)
    return [arm_overrides(a, s, steps, init_hf) for s in SEEDS[:seeds] for a in names]


# ------------------------------------------------------------------------------------------------
# Records.
# ------------------------------------------------------------------------------------------------
def run_record(
    workdir: str, arm: str, seed: int, seconds: list[float], evals_before=()
) -> dict | None:
    """The curves and held-out evaluations of one run so far (None before its first segment).

    A resumed segment drops the rows after its checkpoint from metrics.jsonl, the earlier
    segment-end evaluations included, so `evals_before` (the previous record's) are kept."""
    from dvp_jax import metrics

    summary = local.read_summary(workdir)
    if summary is None:
        return None
    rows = metrics.read_metrics(workdir)
    # One row per step: a segment resumed from an earlier checkpoint logs its steps again.
    train = sorted({int(r["step"]): r for r in rows if r["step"] > 0 and "loss" in r}.items())
    train = [r for _, r in train]
    evals = {int(st): float(a) for st, a in evals_before}
    evals |= {int(r["step"]): float(r["eval_accuracy"]) for r in rows if "eval_accuracy" in r}
    evals = sorted(evals.items())

    method, rung = ARMS[arm]
    return {
        "run": run_name(arm, seed),
        "arm": arm,
        "method": method,
        "rung": rung,
        "seed": seed,
        "steps": int(summary["steps"]),
        "evals": [list(e) for e in evals],
        "steps_logged": [int(r["step"]) for r in train],
        "curves": {k: [float(r[k]) if k in r else None for r in train] for k in CURVES},
        "segment_seconds": seconds,
        "code_version": code_version(),  # the commit that wrote it (issue 46)
    }


def reached(root: str, arm: str, seed: int) -> int:
    summary = local.read_summary(
        os.path.join(os.path.abspath(root), EXPERIMENT, run_name(arm, seed))
    )
    return int(summary["steps"]) if summary else 0


def recorded(out: str, arm: str, seed: int) -> int:
    """The steps in the run's record under `out` (0 if none)."""
    path = os.path.join(out, "units", f"{run_name(arm, seed)}.json")
    if not os.path.exists(path):
        return 0
    with open(path) as fh:
        return int(json.load(fh)["steps"])


def pending(order, root: str, out: str) -> tuple[list, list[str]]:
    """The units of `order` still to run, and one line per run that starts over.

    A run is as far as its workdir (under `root`) reached. Its record (under `out`) is the result
    and its workdir only resumes it, so a run whose workdir is gone counts as done if its record
    is complete (reaches the run's last segment); a partial record without its workdir cannot be
    resumed, so that run starts again from step 0 (and its record is rewritten from the rerun)."""
    last = {}
    for a, s, e in order:
        last[(a, s)] = max(e, last.get((a, s), 0))
    done, notes = {}, []
    for (a, s), end in last.items():
        done[(a, s)] = reached(root, a, s)
        rec = recorded(out, a, s) if not done[(a, s)] else 0
        if rec >= end:
            done[(a, s)] = rec
        elif rec:
            notes.append(
                f"[e006] {run_name(a, s)}: its record reaches step {rec} but its workdir under "
                f"{root} is gone; rerunning it from step 0"
            )
    return [(a, s, e) for a, s, e in order if done[(a, s)] < e], notes


def run_segment(root: str, out: str, arm: str, seed: int, end: int, init_hf: str, smoke=False):
    """Launches one segment (the run resumed to step `end`) and rewrites its record."""
    path = os.path.join(REPO, "experiments", f"{EXPERIMENT}.py")
    sweep = {"steps": end, "init_hf": init_hf, "smoke": smoke}
    if not smoke:
        sweep |= {"arms": arm, "seeds": seed + 1}
    exp = sweeps.load_experiment(path, sweep)
    unit = next(u for u in exp.units if u.name.split("_", 1)[1] == run_name(arm, seed))
    workdir = os.path.join(os.path.abspath(root), EXPERIMENT, run_name(arm, seed))
    prev = os.path.join(out, "units", f"{run_name(arm, seed)}.json")
    seconds, evals = [], []
    at = reached(root, arm, seed)  # 0: a rerun from step 0, which starts clean
    if os.path.exists(prev) and at:
        with open(prev) as fh:
            before = json.load(fh)
        # Only what the workdir being resumed holds: a record ahead of it (a rerun whose earlier
        # segment died before rewriting the record) keeps its evaluations up to `at` and no times.
        evals = [e for e in before.get("evals", []) if e[0] <= at]
        seconds = before.get("segment_seconds", []) if before["steps"] <= at else []
    t0 = time.time()
    result = local.run_unit(exp, unit, workdir, None)
    rec = run_record(workdir, arm, seed, seconds + [round(time.time() - t0, 1)], evals)
    if rec is not None:
        write_record(out, rec)
    return result, rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="/tmp/e006/root", help="the runs' workdirs (not committed)")
    p.add_argument(
        "--out", default="", help=f"results folder (units/, verdict.json, plots); default {OUT}, "
        "with --smoke <root>/results"
    )  # fmt: skip
    p.add_argument("--init_hf", default=WARM_START, help="the warm start's hf_export")
    p.add_argument("--max_units", type=int, default=0, help="stop after this many (0: all)")
    p.add_argument("--status", action="store_true", help="print which units are missing")
    p.add_argument(
        "--lane", default="", help="i/n: only every n-th run from the i-th (n processes)"
    )
    p.add_argument("--smoke", action="store_true", help="CI sizes on a random init")
    args = p.parse_args(argv)
    if args.smoke:
        args.out = args.out or os.path.join(args.root, "results")
        if os.path.abspath(args.out) == os.path.join(REPO, OUT):
            p.error(f"--smoke writes a random model's records: give an --out other than {OUT}")
        order, init_hf = [("icepop_M3", 0, 2)], ""
    else:
        args.out = args.out or OUT
        order, init_hf = unit_order(), args.init_hf
    if args.lane and not args.smoke:
        mine = lane_runs(args.lane)
        order = [(a, s, e) for a, s, e in order if run_name(a, s) in mine]
    todo, notes = pending(order, args.root, args.out)
    for note in notes:
        print(note, flush=True)
    if args.status:
        lane = f" (lane {args.lane})" if args.lane else ""
        print(f"e006{lane}: {len(order) - len(todo)} of {len(order)} units done; next: {todo[:3]}")
        return 0
    for i, (arm, seed, end) in enumerate(todo):
        if args.max_units and i >= args.max_units:
            break
        result, _ = run_segment(args.root, args.out, arm, seed, end, init_hf, args.smoke)
        print(
            f"[e006] {run_name(arm, seed)} to step {end}: "
            f"{'ok' if result.ok else f'FAILED (exit {result.returncode})'} in "
            f"{result.wall_s:.0f} s, held-out {(result.summary or {}).get('eval_accuracy')}",
            flush=True,
        )
        if not result.ok:
            print(f"[e006] see {result.workdir}/launch.log; rerun to resume", flush=True)
            return 1
    rules.main(["--out", args.out] + (["--smoke"] if args.smoke else []))
    if not args.smoke:
        from experiments import e006_plots

        e006_plots.plot_all(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
