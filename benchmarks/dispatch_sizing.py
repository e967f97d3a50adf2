r"""Dispatch sizing (`rollout/scheduler.py`): sized dispatches vs a fixed k steps per dispatch.

  python benchmarks/dispatch_sizing.py               # 16 prompts x 128 tokens, CPU, bf16
  python benchmarks/dispatch_sizing.py --long_tail   # responses stop at EOS, 4 x 16 rows

The 'bench' model of benchmarks/rollout_throughput.py (random, d 256, 4 layers, vocab 4096) on
the default engine (paged decode: the ragged XLA path off TPU). `generate_rollouts` runs the
same prompts and keys twice: with the scheduler sizing each dispatch (as many steps as keep its
span and pages, at least 8) and with `--steps_per_sync` (8, the RL loop's old fixed size); both
make the same tokens. The sides run interleaved after a warm-up and the best time counts. One
JSON line: sized_tok_s, fixed_tok_s, sized_over_fixed_ratio, the dispatches of each, every
run's time.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(__file__))
from rollout_throughput import model_config, run_times  # noqa: E402 (the same model and timer)

from dvp_jax.cli import require_backend  # noqa: E402

# rollout_throughput's flags, under their names: --batch (prompts = slots), --new_tokens,
# --prompt_len, --steps_per_sync (the fixed side, 8), --repeats, --long_tail, --backend.
FLAGS = flags.FLAGS


def main(argv):
    del argv
    require_backend(FLAGS.backend)
    import jax
    import numpy as np
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, Transformer
    from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
    from dvp_jax.rollout.offline import generate_rollouts

    cfg = model_config("bench")
    rows = FLAGS.batch * (4 if FLAGS.long_tail else 1)
    stop = tuple(range(3, 27)) if FLAGS.long_tail else ()
    prompts = np.random.default_rng(0).integers(30, cfg.vocab_size, (rows, FLAGS.prompt_len))
    config = EngineConfig(
        max_concurrent_decodes=FLAGS.batch,
        max_prefill_length=FLAGS.prompt_len,
        max_decode_length=FLAGS.new_tokens,
        stop_tokens=stop,
    )
    engine = RolloutEngine(
        cfg, config, params=nnx.state(Transformer(cfg, TRAIN_POLICY, rngs=nnx.Rngs(0)))
    )
    made, stats = {}, {}

    def run(name, k):
        per = []
        made[name] = generate_rollouts(
            engine, prompts.tolist(), 1, jax.random.key(7), steps_per_sync=k, stats=per
        )
        stats[name] = per[0]

    times = run_times(
        {"sized": lambda: run("sized", None), "fixed": lambda: run("fixed", FLAGS.steps_per_sync)},
        FLAGS.repeats,
    )
    tokens = int(made["sized"].response_lengths.sum())
    same = bool(np.array_equal(made["sized"].tokens, made["fixed"].tokens))
    best = {name: min(t) for name, t in times.items()}
    print(
        json.dumps(
            {
                "sized_tok_s": round(tokens / best["sized"], 1),
                "fixed_tok_s": round(tokens / best["fixed"], 1),
                "sized_over_fixed_ratio": round(best["fixed"] / best["sized"], 3),
                "sized_dispatches": stats["sized"].dispatches,
                "fixed_dispatches": stats["fixed"].dispatches,
                "decode_steps": stats["sized"].steps,
                "tokens": tokens,
                "same_tokens": same,
                "fixed_steps_per_sync": FLAGS.steps_per_sync,
                "long_tail": FLAGS.long_tail,
                "times_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                "backend": jax.default_backend(),
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
