"""e004: does the paper's effect appear under a systematic mismatch with long responses?

Question: with ~170-token high-entropy responses (the running-sum task) and a
deterministic rollout mismatch (the ladder M0 fp32, M1 bf16 + fp8 KV, M2 + fp8 weights, M3 +
int4 weights), does unpruned RLOO degrade (the premise), do DVP and MIS+DVP stay stable (C1), and
does MIS+DVP beat the best unpruned estimator (C2)? Config: configs/e004_running_sum.py (every
unit; the level is `rollout.dtype`, the held-out avg@16 is always sampled by an fp32 engine).

Stages (each resumable: finished pieces are found and skipped; results written as they come):
  0 warm start: one supervised run (`SFT_STEPS`, 0 RL steps) exported once; every unit and
    every stage-1 measurement starts from it (`model.hf_path`, `sft.steps=0`).
  1 power: `e004_measure.measure` samples >= 1,000 responses from the warm start at each
    level (the ladder M0-M3 and the synthetic rung M4; `--stage m4scan` measures M4 at several
    tail-noise strengths first, stage1_m4_scan.json), the same prompts and keys at every level,
    the RLOO rollout (unpruned), and computes the trainer's teacher-forced statistics with the
    trainer's own functions (`train.step.token_stats`, `dvp.diagnostics.tail_metrics`):
    response length, truncation, entropy, E[L], the share of E[L] from outside the e^-13 safe
    set, reward -> results/e004/stage1_levels.json. Then the M0 RLOO gain run (pilot seed 100,
    `get_sweep(stage="gain")`).
  2 premise: RLOO at the level and M0 RLOO, final seeds 0..4 (`get_sweep(stage="premise")`).
  3 methods: TIS, MIS, DVP, MIS+DVP at the level, final seeds (`get_sweep(stage="methods")`).
  Every run is launched in `UNIT_STEPS`-step segments that resume it (<= 15-minute units), whole
  runs one after another in seed-major order; after every segment the unit records go to
  results/e004/units/<unit>.json, and after every stage the gates to results/e004/verdict.json
  (experiments/e004_verdict.py: a unit counts once it has run its pre-registered length, an
  arm once all its final seeds have); a failed gate stops the later stages.

Commands (from the repository root):
  python -m experiments.e004_running_sum --stage 0 --root /tmp/e004/root
  python -m experiments.e004_running_sum --stage m4scan --root /tmp/e004/root [--m4_noise 1,2,3]
  python -m experiments.e004_running_sum --stage 1 --root /tmp/e004/root [--levels M0,M1]
  python -m experiments.e004_running_sum --stage gain --root /tmp/e004/root
  python -m experiments.e004_running_sum --stage 2 --root /tmp/e004/root   # then 3
  (units also run alone: python -m dvp_jax.launch local experiments/e004_running_sum.py
   --sweep stage=gain --sweep init_hf=/tmp/e004/root/e004_running_sum/_init_sft<N>/hf_export)
  Smoke (CI): `--sweep smoke=True` (tests/test_experiments_e004.py).
  (`--sft_steps N` picks another warm start, workdir _init_sft<N>; default `SFT_STEPS`.)
Hardware: 2 CPU cores shared with other jobs (load 2-9). Times: see experiments/README.md, e004.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import sys
import threading

import numpy as np

from dvp_jax.launch import local
from dvp_jax.launch import sweep as sweeps
from experiments import e004_measure as measure_lib
from experiments import e004_verdict as gates

CONFIG = measure_lib.CONFIG
CONFIG_ARG = "rloo:M0"
SUMMARY_KEYS = ("start_eval_accuracy", "eval_accuracy", "final_log_ppl_diff", "wall_time_s")
EXPERIMENT = "e004_running_sum"
OUT = "experiments/results/e004"
CFG = measure_lib.config_module()  # configs/e004_running_sum.py, loaded once
SFT_STEPS = CFG.SFT_STEPS  # the config's warm start (v1: 400)
METHODS = ("rloo", "tis", "mis", "dvp", "mis_dvp")
FINAL_SEEDS = tuple(range(gates.N_FINAL_SEEDS))
# Separate from the final seeds. Seed 100 was the design pilot of v3 (its record, scored on 32
# prompts x 16, is kept in results/e004/v3_design_pilot_s100/); the gate reads seed 101, run under
# the evaluation protocol below, which was fixed and committed before that run started.
PILOT_SEEDS = (101,)
LEVEL = "M4"  # the default level of a stage sweep (the stages pass the verdict's strongest level)
# The pre-registered lengths: stages 2-3 run as long as the gain run that shows M0 RLOO learns.
GAIN_STEPS = gates.GAIN_STEPS
STEPS = gates.FINAL_STEPS
# Each RL run is launched in segments of UNIT_STEPS steps (the pre-registered <= 15-minute
# units on 2 CPU cores, at ~7 s per step): a segment resumes the run from its last
# checkpoint, and its end evaluates held-out accuracy, so a run's record also holds its
# accuracy after every segment.
UNIT_STEPS = 100
# The evaluation protocol of every RL unit (fp32, without logit noise): held-out accuracy on all
# of the task's held-out problems with EVAL_K samples each, at the start and after every segment.
# The mean over 64 samples is an unbiased estimate of avg@16 with 4x the samples; over all 39
# problems it has no prompt-sampling error (binomial SE ~0.007 at accuracy 0.15, so ~0.01 on a
# gain, against the gate's 0.05).
EVAL_K = 64
# RL unit sizes on top of the config (whose RL batch is 8 prompts x 16 responses).
SIZES = {
    "train.learning_rate": 2e-4,
    "eval.every": 0,
    "eval.num_prompts": CFG.HELDOUT_PROBLEMS,
    "eval.k": EVAL_K,
    "checkpoint.every": 10,
    "plots": False,
}
SMOKE = {  # CI sizes: a random model, 2 RL steps, 2 prompts x 2 responses of <= 17 tokens
    "sft.steps": 0,
    "train.steps": 2,
    "train.prompts_per_step": 2,
    "train.group_size": 2,
    "eval.num_prompts": 2,
    "eval.k": 2,
    "eval.every": 0,
    "eval.dtype": "",  # the rollout engine evaluates (one engine compile less)
    "checkpoint.every": 0,
    "plots": False,
    "model.d_model": 32,
    "model.head_dim": 8,
    "model.d_ff": 64,
    "data.running_sum.min_response_len": 14,  # >= 4 * 2 + 2, the least a 2-operand problem needs
    "data.running_sum.max_response_len": 16,
    "rollout.max_decode_length": 17,
}


def unit(method: str, level: str, seed: int, role: str, init_hf: str, steps: int) -> dict:
    """One RL unit from the warm start: `method` at ladder `level`, seed `seed`."""
    return {
        "_name": f"{role}_{method}_{level}_s{seed}",
        "method": method,
        **CFG.level_overrides(level),
        "train.seed": seed,
        "data.seed": seed,
        "train.steps": steps,
        **SIZES,
        "model.hf_path": os.path.abspath(init_hf) if init_hf else "",
        "sft.steps": 0 if init_hf else SFT_STEPS,
    }


def get_sweep(
    stage: str = "gain",
    init_hf: str = "",
    level: str = LEVEL,
    seeds: int = len(FINAL_SEEDS),
    steps: int = STEPS,
    gain_steps: int = GAIN_STEPS,
    smoke: bool = False,
) -> list[dict]:
    """The units of one stage: "gain" (M0 RLOO, pilot seeds), "premise" (RLOO at `level` and
    M0 RLOO, final seeds), "methods" (TIS, MIS, DVP, MIS+DVP at `level`, final seeds).
    `smoke`: one MIS+DVP unit at M3 at the CI sizes (`SMOKE`), from a random init, or from
    `init_hf` (an export of a random model at those sizes: its init is not compiled)."""
    if smoke:
        dtype = CFG.LEVELS["M3"]
        start = {"model.hf_path": os.path.abspath(init_hf)} if init_hf else {}
        return [
            {"_name": "smoke_mis_dvp_M3", "method": "mis_dvp", "rollout.dtype": dtype, **SMOKE}
            | start
        ]
    final = FINAL_SEEDS[:seeds]
    if stage == "gain":
        return [unit("rloo", "M0", s, "gain", init_hf, gain_steps) for s in PILOT_SEEDS]
    # Seed-major, so that a stage cut short has whole seeds of every arm.
    if stage == "premise":
        return [unit("rloo", lv, s, "final", init_hf, steps) for s in final for lv in (level, "M0")]
    if stage == "methods":
        return [
            unit(m, level, s, "final", init_hf, steps)
            for s in final
            for m in ("tis", "mis", "dvp", "mis_dvp")
        ]
    raise ValueError(f"get_sweep(stage={stage!r}): want 'gain', 'premise' or 'methods'")


# ------------------------------------------------------------------------------------------------
# Stage 0: the shared warm start.
# ------------------------------------------------------------------------------------------------
def init_workdir(root: str, sft_steps: int = SFT_STEPS) -> str:
    return os.path.join(os.path.abspath(root), EXPERIMENT, f"_init_sft{sft_steps}")


def prepare_init(root: str, extra: dict | None = None, sft_steps: int = SFT_STEPS) -> str:
    """Runs (once) the supervised warm start (`sft_steps`, no RL, fp32 avg@16 on the held-out
    prompts) and returns its hf_export directory."""
    workdir = init_workdir(root, sft_steps)
    export = os.path.join(workdir, "hf_export")
    if os.path.exists(os.path.join(export, "config.json")):
        return export
    overrides = {"train.steps": 0, "sft.steps": sft_steps, "checkpoint.every": 0, **(extra or {})}
    argv = sweeps.unit_argv(f"{CONFIG}:{CONFIG_ARG}", overrides.items(), workdir, sys.executable)
    print("[e004 stage 0] " + shlex.join(argv), flush=True)
    rc = local.run_logged(argv, workdir)
    if rc:
        raise RuntimeError(f"the warm start failed (exit {rc}); see {workdir}/launch.log")
    return export


# ------------------------------------------------------------------------------------------------
# Stage 1: sampling statistics of the warm start at each level.
# ------------------------------------------------------------------------------------------------
def stage1(
    root: str, out: str, levels, num_prompts: int, samples: int, sft_steps: int = SFT_STEPS
) -> dict:
    """Measures each level not yet in out/stage1_levels.json (same warm start), adding each as
    it finishes."""
    hf = prepare_init(root, sft_steps=sft_steps)
    todo = [(lv, lv, None) for lv in levels]
    path = os.path.join(out, "stage1_levels.json")
    return measure_lib.measure_missing(path, {"init_hf": hf}, "levels", todo, num_prompts, samples)


def scan_m4(
    root: str, out: str, strengths, num_prompts: int, samples: int, sft_steps: int = SFT_STEPS
) -> dict:
    """Stage 1 of the synthetic rung M4 at each tail-noise strength (`rollout.noise_std`) not yet
    in out/stage1_m4_scan.json; the config's `M4_NOISE_STD` is then chosen from it."""
    hf = prepare_init(root, sft_steps=sft_steps)
    todo = [(f"{float(x):g}", "M4", {"rollout.noise_std": float(x)}) for x in strengths]
    head = {"init_hf": hf, "tail_noise_gap": CFG.TAIL_NOISE_GAP}
    path = os.path.join(out, "stage1_m4_scan.json")
    return measure_lib.measure_missing(path, head, "strengths", todo, num_prompts, samples)


# ------------------------------------------------------------------------------------------------
# RL units: run through the launcher, then one compact record each (units/<unit>.json).
# ------------------------------------------------------------------------------------------------
def unit_record(workdir: str, overrides: dict, previous: dict | None = None) -> dict | None:
    """The record the gates read, from a finished unit's summary.json, config.json and
    metrics.jsonl. `previous`: the record written after an earlier segment of the same run, whose
    held-out evaluations (`evals`, [step, accuracy] pairs) this one keeps."""
    from dvp_jax import metrics

    summary = local.read_summary(workdir)
    if summary is None:
        return None
    with open(os.path.join(workdir, "config.json")) as fh:
        config = json.load(fh)
    evals = [[0, summary["start_eval_accuracy"]]]
    if previous and previous.get("start_acc") == summary["start_eval_accuracy"]:  # same run
        evals += [e for e in previous.get("evals", []) if 0 < e[0] < summary["steps"]]
    evals.append([summary["steps"], summary["eval_accuracy"]])
    rows = [r for r in metrics.read_metrics(workdir) if r["step"] > 0 and "loss" in r]
    series = lambda k: [float(r[k]) for r in rows if k in r]
    name = os.path.basename(workdir)
    return {
        "unit": name,
        "role": name.split("_")[1],  # "NN_role_method_level_sSEED"
        "method": overrides["method"],
        "level": CFG.level_of(overrides),
        "seed": overrides.get("train.seed", 0),
        "steps": summary["steps"],
        "start_acc": summary["start_eval_accuracy"],
        "final_acc": summary["eval_accuracy"],
        # Responses behind each accuracy figure (held-out prompts x samples per prompt).
        "eval_responses": config["eval.num_prompts"] * config["eval.k"],
        "evals": evals,
        "indicators": gates.collapse_indicators(
            series("log_ppl_diff"), series("grad_norm"), series("entropy")
        ),
        "abs_seq_log_ratio": float(np.mean(np.abs(series("seq_log_ratio")))),
        "abs_seq_log_ratio_pruned": float(np.mean(np.abs(series("seq_log_ratio_pruned")))),
        "mean_response_length": float(np.mean(series("response_length"))),
        "mean_truncation_rate": float(np.mean(series("truncation_rate"))),
        "wall_time_s": summary["wall_time_s"],
        "curves": {
            k: series(k)
            for k in (
                "reward_mean",
                "entropy",
                "log_ppl_diff",
                "grad_norm",
                "seq_log_ratio",
                "seq_log_ratio_pruned",
                "response_length",
            )
        },
    }


def segment_ends(steps: int, unit_steps: int) -> list[int]:
    """The step at which each segment of a `steps`-step run ends: every `unit_steps`, then
    `steps`."""
    if steps < 1 or unit_steps < 1:
        raise ValueError(
            f"segment_ends: steps ({steps}) and unit_steps ({unit_steps}) must be >= 1"
        )
    return [*range(unit_steps, steps, unit_steps), steps]


def reached(root: str, name: str) -> int:
    """The steps of the last finished segment of run `name` under `root` (0 if none)."""
    summary = local.read_summary(os.path.join(os.path.abspath(root), EXPERIMENT, name))
    return int(summary["steps"]) if summary else 0


def run_stage(
    root: str, out: str, stage: str, parallel: int, sweep: dict, unit_steps: int = UNIT_STEPS
) -> list[dict]:
    """Runs a stage's runs, `parallel` at a time in sweep order, each on its own segment by
    segment (every segment a launch unit that resumes its run from the last checkpoint), writing
    the records after every segment. A segment its run's summary already reached is not
    relaunched (its checkpoint may be past that step, which the trainer refuses). After a failed
    segment no new segment starts; the stage raises once the running ones end. The premise stage
    also starts no new segment once its gate is decided before all seeds have run
    (`e004_verdict.premise_gate`: a collapse majority out of reach); the segments in flight end."""
    path = os.path.join(sweeps.REPO, "experiments", f"{EXPERIMENT}.py")
    length = "gain_steps" if stage == "gain" else "steps"
    lock = threading.Lock()  # the records and the failure and decided lists
    failures: list[str] = []
    decided: list[str] = []

    def run(unit) -> None:
        workdir = os.path.join(os.path.abspath(root), EXPERIMENT, unit.name)
        for end in segment_ends(sweep[length], unit_steps):
            if failures or decided:
                return
            if reached(root, unit.name) >= end:
                continue
            exp = sweeps.load_experiment(path, {**sweep, length: end})
            print(f"[e004 {stage}] {unit.name}: segment to step {end}", flush=True)
            result = local.run_unit(exp, exp.units[unit.index], workdir, None)
            held_out = (result.summary or {}).get("eval_accuracy")
            print(
                f"[e004 {stage}] {unit.name}: step {end} "
                f"{'ok' if result.ok else f'FAILED (exit {result.returncode})'} in "
                f"{result.wall_s:.0f} s, held-out avg@16 {held_out}",
                flush=True,
            )
            with lock:
                records = write_records(root, out)
                if stage == "premise" and not decided:
                    premise = gates.gates_from_results(levels, records)["premise"]
                    if premise.get("decided_early"):
                        decided.append(premise["decided_early"])
                        print(
                            f"[e004 {stage}] premise decided: {decided[0]}; "
                            "no further segments start",
                            flush=True,
                        )
                if not result.ok:
                    failures.append(
                        f"{unit.name} failed at the segment to step {end} "
                        f"(exit {result.returncode}); see {workdir}/launch.log"
                    )
                    return

    levels = gates.read_levels(out)  # stage 1's figures: fixed while a stage runs
    units = sweeps.load_experiment(path, sweep).units
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(run, units))
    if failures:
        raise RuntimeError(f"e004 {stage}: {failures[0]}")
    return write_records(root, out)


def write_records(root: str, out: str) -> list[dict]:
    """units/<unit>.json for every finished unit under root/e004_running_sum."""
    base = os.path.join(os.path.abspath(root), EXPERIMENT)
    records = []
    os.makedirs(os.path.join(out, "units"), exist_ok=True)
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        workdir = os.path.join(base, name)
        if name.startswith(("_", "smoke")) or not os.path.isdir(workdir):
            continue
        from experiments.analyze import unit_overrides

        path = os.path.join(out, "units", f"{name}.json")
        previous = None
        if os.path.exists(path):
            with open(path) as fh:
                previous = json.load(fh)
        rec = unit_record(workdir, unit_overrides(workdir), previous)
        if rec is not None:
            records.append(rec)
            with open(path + ".tmp", "w") as fh:  # a kill mid-write leaves the old record
                json.dump(rec, fh, indent=1)
            os.replace(path + ".tmp", path)
    return records


def write_verdict(out: str) -> dict:
    gates.main(["--out", out])
    with open(os.path.join(out, "verdict.json")) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--stage", required=True, choices=("0", "1", "m4scan", "gain", "2", "3", "verdict")
    )
    p.add_argument("--root", default=sweeps.DEFAULT_ROOT, help="root of the unit workdirs")
    p.add_argument("--out", default=OUT, help="results folder")
    p.add_argument("--levels", default="M0,M1,M2,M3,M4", help="stage 1: levels to measure")
    p.add_argument("--m4_noise", default="1,2,3", help="m4scan: tail-noise strengths (sigma)")
    p.add_argument("--prompts", type=int, default=64, help="stage 1: prompts (x --samples)")
    p.add_argument("--samples", type=int, default=16, help="stage 1: responses per prompt")
    p.add_argument("--parallel", type=int, default=1, help="RL units at a time")
    p.add_argument("--seeds", type=int, default=len(FINAL_SEEDS), help="final seeds (stages 2-3)")
    p.add_argument("--steps", type=int, default=STEPS, help="RL steps (stages 2-3)")
    p.add_argument("--gain_steps", type=int, default=GAIN_STEPS, help="RL steps of the gain run")
    p.add_argument(
        "--unit_steps", type=int, default=UNIT_STEPS, help="RL steps per launched segment"
    )
    p.add_argument("--sft_steps", type=int, default=SFT_STEPS, help="SFT steps of the warm start")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.stage == "0":
        print(prepare_init(args.root, sft_steps=args.sft_steps))
        return 0
    if args.stage == "1":
        data = stage1(
            args.root, args.out, args.levels.split(","), args.prompts, args.samples, args.sft_steps
        )
        measure_lib.plot_levels(data["levels"], os.path.join(args.out, "stage1_levels.png"))
    elif args.stage == "m4scan":
        strengths = [float(x) for x in args.m4_noise.split(",")]
        scan_m4(args.root, args.out, strengths, args.prompts, args.samples, args.sft_steps)
        return 0
    elif args.stage != "verdict":
        v = write_verdict(args.out)
        if args.stage == "2" and v["premise"].get("decided_early"):
            print(
                f"[e004] stage 2 not run: the premise is decided ({v['premise']['decided_early']})"
            )
            return 0
        blocked = {"2": ("power",), "3": ("power", "premise")}.get(args.stage, ())
        for gate in blocked:
            if v[gate]["pass"] is not True:
                print(
                    f"[e004] stage {args.stage} not run: gate {gate} is {v[gate]['pass']} "
                    f"({v['verdict']})"
                )
                return 1
        stage = {"gain": "gain", "2": "premise", "3": "methods"}[args.stage]
        sweep = {
            "stage": stage,
            "init_hf": prepare_init(args.root, sft_steps=args.sft_steps),
            "steps": args.steps,
            "gain_steps": args.gain_steps,
            "seeds": args.seeds,
            "level": v["level"],
        }
        try:
            records = run_stage(args.root, args.out, stage, args.parallel, sweep, args.unit_steps)
        except RuntimeError as e:  # a failed segment: its log says why; rerun to resume
            print(f"[e004] {e}", flush=True)
            return 1
        measure_lib.plot_units(records, os.path.join(args.out, "units.png"))
    v = write_verdict(args.out)
    print(json.dumps({"verdict": v["verdict"], "level": v["level"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
