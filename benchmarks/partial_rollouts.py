r"""Partial rollouts (`rollout.partial`) vs synchronous ones: trained responses per second over
several RL steps on a long-tail length mix, with a weight update between steps.

  python benchmarks/partial_rollouts.py               # CPU: both sides, one JSON line
  python benchmarks/partial_rollouts.py --nopartial   # the synchronous side alone

The model is rollout_throughput.py's 'bench' (random, 4 layers, vocab 4096, 8 query and 4 KV
heads of 32) at `--d_model` 512 (bench's own is 256; the KV per token does not change). Responses
end at `--stop_ids` token ids: the random model samples one with a roughly constant chance per
step, so lengths are geometric with a mean of about vocab / stop_ids (21 here), cut at
`--max_new_tokens` (200, over 8x the mean), and every step's mix has a long tail. Each RL step
takes P = `--groups` groups of G = `--group_size` responses: synchronously (the step's P
prompts, every response decoded to its end), or partially (`rollout/partial.py`: up to
`--oversample` x P groups in flight, the step ends when P are complete, the rest carried into
the next step). Between steps the weights change (one of two weight sets made beforehand, cast
into the engine as a weight sync does; the sync is timed), so carried responses are prefilled
again with new weights. rollout_throughput.py's `--page_size` (64) and `--repeats` (3) apply.

Why float32 and d 512 by default. Partial rollouts save decode steps, each a read of the weights,
and pay with more program calls (a refill at each finish) and the carried responses' prefill.
  - XLA:CPU has no bf16 matmul: a bf16 engine's program converts every weight to f32 once per
    call, outside the decode loop (at d 512 a call's fixed cost is 9.5 ms in bf16 against 2.6
    ms in float32, with steps of 7.3 and 6.4 ms: benchmarks/decode_call_cost.py), a cost an
    accelerator does not have and which lands on the side with more calls. `--dtype=bfloat16`
    measures it.
  - The host's work per dispatch (the scheduler, the records read back) and a call's fixed cost
    weigh less against a d 512 step (6.4 ms, 16 slots) than against a d 256 one (4.8 ms): the
    ratio is 1.56 at d 256 and 1.67 at d 512 (docs/results.md, with the bf16 figures).

Each side first runs its `--rl_steps` once to compile every program shape (prefill and resume
buckets), then `--repeats` more times, interleaved with the other side's, on the same prompts,
keys and weights; each side's fastest pass counts. One JSON line: sync and partial trained
responses per second, partial_over_sync_ratio (target >= 1.5), decode steps per RL step, mean
token age, every step's time of the counted passes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(__file__))
from rollout_throughput import model_config  # noqa: E402 (the same model)

FLAGS = flags.FLAGS
flags.DEFINE_bool("partial", True, "Run the partial side beside the synchronous one.")
flags.DEFINE_integer("groups", 4, "P: groups trained per RL step.")
flags.DEFINE_integer("group_size", 4, "G: responses per group.")
flags.DEFINE_integer("slots", 16, "Decode slots.")
flags.DEFINE_float("oversample", 2.0, "Partial side: up to this x P groups in flight.")
flags.DEFINE_integer("rl_steps", 12, "RL steps per pass of each side.")
flags.DEFINE_integer("max_new_tokens", 200, "The cap of a response (>= 8x the mean).")
flags.DEFINE_integer("stop_ids", 200, "Token ids that end a response (mean ~ vocab / this).")
flags.DEFINE_integer("d_model", 512, "The bench model's residual width (module docstring).")


def run_partial() -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, Transformer
    from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
    from dvp_jax.rollout.offline import generate_rollouts
    from dvp_jax.rollout.partial import PartialRollout

    cfg = model_config(FLAGS.preset)  # rollout_throughput.py's --preset (default "bench")
    if FLAGS.preset == "bench":
        cfg = dataclasses.replace(cfg, d_model=FLAGS.d_model)
    p, g = FLAGS.groups, FLAGS.group_size
    stop = tuple(range(3, 3 + FLAGS.stop_ids))
    config = EngineConfig(
        max_concurrent_decodes=FLAGS.slots,
        max_prefill_length=16,
        max_decode_length=FLAGS.max_new_tokens,
        stop_tokens=stop,
        page_size=FLAGS.page_size,
        dtype=FLAGS.dtype,
    )
    master = nnx.state(Transformer(cfg, TRAIN_POLICY, rngs=nnx.Rngs(0)))
    engine = RolloutEngine(cfg, config, params=master)
    rng = np.random.default_rng(0)
    steps = FLAGS.rl_steps
    prompts = rng.integers(3 + FLAGS.stop_ids, cfg.vocab_size, (4 * p * steps, 12)).tolist()
    base = jax.random.key(3)

    def perturbed(seed):
        """The master weights moved by a small random step (a stand-in for an update)."""
        key = jax.random.fold_in(jax.random.key(11), seed)
        leaves, tree = jax.tree.flatten(master)
        keys = jax.random.split(key, len(leaves))
        moved = [
            x + 1e-3 * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ]
        return jax.tree.unflatten(tree, moved)

    # Two weight sets, made before the clock starts: the update is not what is measured, the
    # sync into the engine (`update_params`, timed) and the rollout under new weights are.
    updates = [perturbed(0), perturbed(1)]

    def new_weights(step):
        """The weight update between steps: another weight set, synced into the engine."""
        engine.update_params(updates[step % 2])

    def sync_side():
        engine.update_params(master)  # every pass of either side starts from the same weights
        times, lengths, decode_steps = [], [], []
        for step in range(steps):
            t = time.perf_counter()
            stats = []
            batch = generate_rollouts(
                engine,
                prompts[step * p : (step + 1) * p],
                g,
                base,
                first_prompt_index=step * p,
                stats=stats,
            )
            decode_steps.append(stats[0].steps)
            new_weights(step)
            jax.block_until_ready(engine.params)
            times.append(time.perf_counter() - t)
            lengths += batch.response_lengths.tolist()
        return times, lengths, decode_steps

    def partial_side():
        engine.update_params(master)
        partial = PartialRollout(engine, g, p, FLAGS.oversample, max_staleness=steps)
        drawn = iter(range(len(prompts)))

        def draw(n):
            out = []
            for _ in range(n):
                i = next(drawn)
                key = np.asarray(jax.random.key_data(jax.random.fold_in(base, i)))
                out.append((prompts[i], i, key))
            return out

        times, decode_steps, ages = [], [], []
        for step in range(steps):
            t = time.perf_counter()
            batch, _, stats = partial.generate(engine.params, step, draw)
            new_weights(step)
            jax.block_until_ready(engine.params)
            times.append(time.perf_counter() - t)
            decode_steps.append(stats.decode_steps)
            ages += (step - batch.behaviour_version[batch.response_mask]).tolist()
        return times, decode_steps, ages

    # A first pass of each side compiles every program shape later passes meet (prefill and
    # resume buckets); then `--repeats` passes of each, interleaved (the same prompts, keys
    # and weights each time: the same work), and each side's fastest pass counts, so a busy
    # spell on a shared machine does not land on one side only.
    sides = {"sync": sync_side, "partial": partial_side} if FLAGS.partial else {"sync": sync_side}
    best = {}
    for rep in range(FLAGS.repeats + 1):
        for name, side in sides.items():
            out = side()
            if rep and (name not in best or sum(out[0]) < sum(best[name][0])):
                best[name] = out
    sync_times, lengths, sync_steps = best["sync"]
    trained = p * g * FLAGS.rl_steps
    sync_rate = trained / sum(sync_times)
    if not FLAGS.partial:
        return {
            "sync_responses_per_s": round(sync_rate, 2),
            "sync_decode_steps_per_step": round(float(np.mean(sync_steps)), 1),
            "response_length_mean": round(float(np.mean(lengths)), 1),
            "sync_step_s": [round(x, 3) for x in sync_times],
            "engine_dtype": FLAGS.dtype,
            "d_model": cfg.d_model,
            "backend": jax.default_backend(),
        }
    partial_times, decode_steps, ages = best["partial"]
    partial_rate = trained / sum(partial_times)
    return {
        "sync_responses_per_s": round(sync_rate, 2),
        "partial_responses_per_s": round(partial_rate, 2),
        "partial_over_sync_ratio": round(partial_rate / sync_rate, 3),
        "oversample": FLAGS.oversample,
        "groups": p,
        "group_size": g,
        "slots": FLAGS.slots,
        "response_length_mean": round(float(np.mean(lengths)), 1),
        "response_length_max": int(np.max(lengths)),
        "max_new_tokens": FLAGS.max_new_tokens,
        "sync_decode_steps_per_step": round(float(np.mean(sync_steps)), 1),
        "partial_decode_steps_per_step": round(float(np.mean(decode_steps)), 1),
        "partial_mean_token_age": round(float(np.mean(ages)), 3),
        "sync_step_s": [round(x, 3) for x in sync_times],
        "partial_step_s": [round(x, 3) for x in partial_times],
        "engine_dtype": FLAGS.dtype,
        "d_model": cfg.d_model,
        "backend": jax.default_backend(),
    }


def main(argv):
    del argv
    print(json.dumps(run_partial()))


if __name__ == "__main__":
    FLAGS.set_default("dtype", "float32")  # rollout_throughput.py's flag (module docstring)
    app.run(main)
