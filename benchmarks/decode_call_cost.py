r"""What one decode-loop call costs beyond its steps, per engine dtype: the fixed cost a dispatch
pays once (its program's launch and whatever the compiler hoisted out of the loop) and the cost
of each decode step.

  python benchmarks/decode_call_cost.py                  # bf16 and float32 at d 512
  python benchmarks/decode_call_cost.py --d_model 256

The model of benchmarks/partial_rollouts.py (rollout_throughput.py's 'bench' at `--d_model`),
16 slots filled with 12-token prompts, on the default paged engine; `generate_steps` runs k = 2,
4, 8, 16 steps (no slot finishes), each timed to its results on the host, median of `--reps`
after a compile. A least-squares line over k gives the per-call intercept and the per-step
slope, for each dtype in `--dtypes`. On CPU a bf16 engine's intercept is large: XLA:CPU has no
bf16 matmul and converts every weight to f32 once per call, outside the loop; an accelerator
multiplies bf16 as it is. One JSON line: {dtype: {intercept_ms, step_ms, k_ms}}, and
bf16_over_f32_intercept_ratio.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(__file__))
from rollout_throughput import model_config  # noqa: E402 (the same model)

FLAGS = flags.FLAGS
flags.DEFINE_integer("d_model", 512, "The bench model's residual width.")
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Engine dtypes to measure.")
flags.DEFINE_integer("reps", 9, "Timed calls per step count (the median counts).")
STEPS = (2, 4, 8, 16)  # k = 1 would run the single-step program, not the loop


def measure(dtype: str) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, Transformer
    from dvp_jax.rollout.engine import EngineConfig, RolloutEngine

    cfg = dataclasses.replace(model_config("bench"), d_model=FLAGS.d_model)
    config = EngineConfig(
        max_concurrent_decodes=16,
        max_prefill_length=16,
        max_decode_length=200,
        stop_tokens=(),
        dtype=dtype,
    )
    master = nnx.state(Transformer(cfg, TRAIN_POLICY, rngs=nnx.Rngs(0)))
    engine = RolloutEngine(cfg, config, params=master)
    slots = list(range(16))
    prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (16, 12)).tolist()
    prefix = engine.prefill_batch(engine.params, prompts, np.zeros((16, 2), np.uint32))

    def placed():
        state = engine.insert_batch(prefix, engine.init_decode_state(), slots, slots, slots)
        return jax.block_until_ready(state)

    times = {}
    for k in STEPS:
        jax.block_until_ready(engine.generate_steps(engine.params, placed(), k))  # compile
        runs = []
        for _ in range(FLAGS.reps):
            state = placed()
            t = time.perf_counter()
            state = engine.generate_steps(engine.params, state, k)
            jax.device_get((state.step, state.done))
            runs.append(time.perf_counter() - t)
        times[k] = 1e3 * statistics.median(runs)
    slope, intercept = np.polyfit(np.asarray(STEPS, float), [times[k] for k in STEPS], 1)
    return {
        "intercept_ms": round(float(intercept), 2),
        "step_ms": round(float(slope), 2),
        "k_ms": {k: round(v, 2) for k, v in times.items()},
    }


def main(argv):
    del argv
    out = {dtype: measure(dtype) for dtype in FLAGS.dtypes}
    if {"bfloat16", "float32"} <= set(out):
        ratio = out["bfloat16"]["intercept_ms"] / max(out["float32"]["intercept_ms"], 1e-3)
        out["bf16_over_f32_intercept_ratio"] = round(ratio, 2)
    out["d_model"] = FLAGS.d_model
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
