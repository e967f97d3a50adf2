r"""The engine's own mismatch (`rollout/invariance.py`) next to the bf16 precision mismatch.

  python benchmarks/engine_invariance.py                     # 16 requests, float32 and bf16, CPU
  python benchmarks/engine_invariance.py --dtypes bfloat16   # one precision

The tiny model (init_std 0.5, as the rollout tests) with float32 master weights; 16 fixed
requests (prompts of 2 to 8 tokens, one key each, char tokenizer stop tokens, up to 24 tokens)
through 4 slots. For each precision the reference run (ragged XLA path, every request through
the slots at once, sized dispatches, a full pool) is compared with: each request alone, each
in the last slot behind 3 others, one step per dispatch, a pool of 1.5 slots (evictions and
re-decoding), the dense cache and the Pallas kernel (TPU interpret mode off TPU). One JSON line:
per precision, the reference's precision mismatch (|log mu_S - log pi_S| against the float32
trainer on the same tokens) and per condition tokens / bitwise equality, the diverged rows,
max / mean |delta log mu_S| over the tokens sampled identically, their ratio to the precision
mismatch, that run's own precision mismatch and its evictions.
"""

from __future__ import annotations

import json

from absl import app, flags

from dvp_jax.cli import require_backend

flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Rollout precisions to measure.")
flags.DEFINE_integer("requests", 16, "Requests (prompts, one sample each).")
flags.DEFINE_integer("slots", 4, "max_concurrent_decodes.")
flags.DEFINE_integer("new_tokens", 24, "max_decode_length.")
flags.DEFINE_integer("page_size", 4, "Positions per KV page.")
flags.DEFINE_list("conditions", [], "Conditions to run (default: all of invariance.CONDITIONS).")
flags.DEFINE_integer("seed", 1, "The batch key.")
flags.DEFINE_string("backend", None, "Require this jax backend (cpu, gpu, tpu).")
FLAGS = flags.FLAGS

PROMPT_LEN = 8


def main(argv):
    del argv
    require_backend(FLAGS.backend)
    import jax
    import numpy as np
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer
    from dvp_jax.rollout import invariance
    from dvp_jax.rollout.engine import EngineConfig

    cfg = ModelConfig.preset("tiny", init_std=0.5)
    gen = np.random.default_rng(0)
    # BOS (1) then 1 to 7 tokens away from the char tokenizer's special ids.
    prompts = [
        [1] + gen.integers(3, 40, gen.integers(1, PROMPT_LEN)).tolist()
        for _ in range(FLAGS.requests)
    ]
    master = Transformer(cfg, TRAIN_POLICY, rngs=nnx.Rngs(0))
    pages_per_slot = -(-(PROMPT_LEN + FLAGS.new_tokens) // FLAGS.page_size)
    short_pages = pages_per_slot * 3 // 2  # 1.5 slots at full length
    conditions = FLAGS.conditions or tuple(invariance.CONDITIONS)
    result = {}
    for dtype in FLAGS.dtypes:
        base = EngineConfig(
            dtype=dtype,
            max_concurrent_decodes=FLAGS.slots,
            max_prefill_length=PROMPT_LEN,
            prefill_buckets=(),
            max_decode_length=FLAGS.new_tokens,
            log_rho=-3.0,
            page_size=FLAGS.page_size,
        )
        figures = invariance.measure(
            cfg, master, base, prompts, jax.random.key(FLAGS.seed), conditions, short_pages
        )
        precision = figures["reference"]["precision"]["mean_abs"]
        for name in conditions:
            f = figures[name]
            f["mean_dlogp_over_precision"] = round(f["mean_dlogp"] / precision, 4)
        result[dtype] = figures
    rounded = lambda x: float(f"{x:.3g}") if isinstance(x, float) else x
    print(
        json.dumps(
            {
                "requests": FLAGS.requests,
                "slots": FLAGS.slots,
                "new_tokens": FLAGS.new_tokens,
                "page_size": FLAGS.page_size,
                "short_pool_pages": short_pages,
                "full_pool_pages": pages_per_slot * FLAGS.slots,
                **jax.tree.map(rounded, result),
                "backend": jax.default_backend(),
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
