"""e000 smoke: two tiny work units (RLOO vs DVP) through the real trainer, for CI.

Question: does the whole loop (SFT warm-up, rollout, train step, eval, checkpoint, summary.json)
  run end to end for a pruned and an unpruned method? Not a science experiment.
Command:
  python experiments/launch.py experiments/e000_smoke.py --root /tmp/dvp_smoke [--parallel 2]
Hardware: 2 CPU cores.
Expected: both units exit 0 and write summary.json; the table shows their (meaningless, 2-step)
  accuracies. Time: ~40 s per unit on 2 shared CPU cores (measured: 42 s and 38 s).
"""

CONFIG = "configs/tiny_cpu.py"
CONFIG_ARG = "dvp"

# Tiny sizes shared by every unit: 2 SFT + 2 RL steps, 4 prompts x 2 responses, 8 eval prompts.
_TINY = {
    "sft.steps": 2,
    "sft.warmup_steps": 0,
    "sft.batch_size": 8,
    "train.steps": 2,
    "train.prompts_per_step": 4,
    "train.group_size": 2,
    "eval.num_prompts": 8,
    "eval.k": 2,
    "eval.every": 0,
    "checkpoint.every": 0,
    "plots": False,
}


def get_sweep() -> list[dict]:
    return [{"method": method, **_TINY} for method in ("rloo", "dvp")]
