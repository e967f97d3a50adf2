r"""Rollout throughput: our JetStream engine vs Hugging Face `generate` on the same weights.

  python benchmarks/rollout_throughput.py                 # 'bench' size, bf16 engine
  python benchmarks/rollout_throughput.py --size=tiny --dtype=float32

One process, CPU. A random Qwen3 model of the chosen size is exported with `save_hf`, then loaded
by `transformers.Qwen3ForCausalLM` (PyTorch, float32) and by our `RolloutEngine` (through
`hf_import.load_hf`). Both sample 16 prompts x 128 new tokens with temperature 1 and the same
min-p rule (HF `min_p = rho = e^-13`, top-k and top-p off); neither stops early (HF
`min_new_tokens = 128`, engine `stop_tokens = ()`), so both produce exactly 16 * 128 tokens.
Our side is `offline.generate_rollouts` (16 prefills, continuous batching over 16 slots, per-token
behaviour log-probs recorded). Each side runs once to warm up (JIT compile), then `--repeats`
times, interleaved with the other side; the best time counts. Prints one JSON line:
engine_tok_s, hf_tok_s, ratio_vs_hf (target >= 3), the settings and every run's time.

Sizes: 'tiny' is the test preset (d 32, 2 layers, vocab 64); 'bench' (default) is a small but
less degenerate model: d 256, 4 layers, 8 heads / 4 KV heads of 32, ffw 768, vocab 4096.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time

from absl import app, flags

# PyTorch's OpenMP threads busy-wait at barriers by default; on a shared machine (other jobs on
# the cores) that makes HF generate 10-100x slower and the ratio meaningless. Passive waiting
# keeps the baseline stable; set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dvp_jax.model.config import PRECISIONS  # noqa: E402 (after the OpenMP setting)

FLAGS = flags.FLAGS
flags.DEFINE_enum("size", "bench", ["tiny", "bench"], "Model size (see the docstring).")
flags.DEFINE_enum("dtype", "bfloat16", list(PRECISIONS), "Engine dtype.")
flags.DEFINE_integer("batch", 16, "Prompts (= decode slots).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("prompt_len", 16, "Prompt length in tokens.")
flags.DEFINE_integer("steps_per_sync", 1, "Engine decode steps per dispatch / host check.")
flags.DEFINE_integer("repeats", 3, "Timed runs per side (interleaved; best counts).")

LOG_RHO = -13.0


def model_config(size: str):
    from dvp_jax.model import ModelConfig

    if size == "tiny":
        return ModelConfig.preset("tiny")
    return ModelConfig(
        vocab_size=4096,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        d_ff=768,
        rope_theta=10_000.0,
        tie_embeddings=True,
        max_position_embeddings=1024,
    )


def run_times(fns: dict, repeats: int) -> dict:
    """Wall times of each function's runs after one warm-up. Runs are interleaved (A B A B ...)
    so that load from other processes on a shared machine hits both sides alike."""
    for fn in fns.values():
        fn()  # warm-up (compilation)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv):
    del argv
    import jax
    import numpy as np
    import torch
    from flax import nnx
    from transformers import Qwen3ForCausalLM

    from dvp_jax.model import TRAIN_POLICY, DTypePolicy, Transformer
    from dvp_jax.model.hf_import import load_hf, save_hf
    from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
    from dvp_jax.rollout.offline import generate_rollouts
    from dvp_jax.sharding import ROLLOUT_RULES, MeshConfig, Sharder, make_mesh

    cfg = model_config(FLAGS.size)
    b, m, p = FLAGS.batch, FLAGS.new_tokens, FLAGS.prompt_len
    prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(b, p)).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hf")
        save_hf(Transformer(cfg, TRAIN_POLICY, rngs=nnx.Rngs(0)), path)

        # --- Hugging Face transformers (PyTorch CPU, float32). ---
        hf = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        input_ids = torch.tensor(prompts)

        def run_hf():
            with torch.no_grad():
                out = hf.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    min_p=math.exp(LOG_RHO),
                    max_new_tokens=m,
                    min_new_tokens=m,
                    pad_token_id=0,
                )
            assert out.shape == (b, p + m), out.shape

        # --- Our engine, weights through hf_import. ---
        mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
        sharder = Sharder(mesh, ROLLOUT_RULES)
        model = load_hf(path, DTypePolicy.named(FLAGS.dtype), sharder)
        engine = RolloutEngine(
            cfg,
            EngineConfig(
                dtype=FLAGS.dtype,
                max_concurrent_decodes=b,
                max_prefill_length=p,
                max_decode_length=m,
                log_rho=LOG_RHO,
                stop_tokens=(),
            ),
            params=nnx.state(model),
            mesh=mesh,
        )
        keys = iter(range(1_000))

        def run_engine():
            batch = generate_rollouts(
                engine, prompts, 1, jax.random.key(next(keys)), steps_per_sync=FLAGS.steps_per_sync
            )
            assert (batch.response_lengths == m).all()

        times = run_times({"hf": run_hf, "engine": run_engine}, FLAGS.repeats)
        hf_s, engine_s = min(times["hf"]), min(times["engine"])

    tokens = b * m
    result = {
        "engine_tok_s": round(tokens / engine_s, 1),
        "hf_tok_s": round(tokens / hf_s, 1),
        "ratio_vs_hf": round(hf_s / engine_s, 2),
        "size": FLAGS.size,
        "engine_dtype": FLAGS.dtype,
        "hf_dtype": "float32",
        "batch": b,
        "new_tokens": m,
        "prompt_len": p,
        "steps_per_sync": FLAGS.steps_per_sync,
        "hf_runs_s": [round(t, 3) for t in times["hf"]],
        "engine_runs_s": [round(t, 3) for t in times["engine"]],
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
