"""e000 smoke: two tiny work units (RLOO vs DVP) through the real trainer, for CI.

Question: does the whole loop (SFT warm-up, rollout, train step, eval, checkpoint, summary.json)
  run end to end for a pruned and an unpruned method? Not a science experiment.
Command (from the repository root):
  python -m dvp_jax.launch local experiments/e000_smoke.py --root /tmp/dvp_smoke [--parallel 2]
Hardware: 2 CPU cores.
Expected: both units exit 0 and write summary.json; the table shows their (meaningless, 2-step)
  accuracies. Time: ~40 s per unit on 2 shared CPU cores (measured: 42 s and 38 s).
"""

from experiments.analyze import SMOKE, TINY_CPU

CONFIG = TINY_CPU
CONFIG_ARG = "dvp"


def get_sweep() -> list[dict]:
    """RLOO and DVP at the tiny CI sizes (`analyze.SMOKE`)."""
    return [{"method": method, **SMOKE} for method in ("rloo", "dvp")]
