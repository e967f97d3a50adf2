r"""Rollout throughput: our JetStream engine vs Hugging Face `generate` on the same weights.

  python benchmarks/rollout_throughput.py                 # 'bench' size, bf16 engine, CPU
  python benchmarks/rollout_throughput.py --long_tail     # paged vs dense decode, EOS stops
  python benchmarks/rollout_throughput.py --preset=qwen3_0_6b --batch=64 --group=1 --prompt_len=128 --new_tokens=256 --steps_per_sync=8 --repeats=2

A random model of `--preset` ('bench': d 256, 4 layers, vocab 4096; or any `ModelConfig`
preset) is saved with `save_hf` and loaded by `transformers.Qwen3ForCausalLM` (CPU float32,
CUDA bfloat16) and by `offline.generate_rollouts` on our engine. Both sample at temperature 1
with the same min-p rule and never stop early, so both make batch x new_tokens tokens; the
sides run interleaved after a warm-up and the best time counts. One JSON line: engine_tok_s,
hf_tok_s, ratio_vs_hf (target >= 3 on CPU at 'bench'), ms_per_step, roofline_tok_s (weights
plus the mean live KV cache read once per step at the memory bandwidth), frac_of_roofline,
bandwidth_Bps and its source (a per-device table; measured by a copy on CPU), every run's time.

`--long_tail`: responses that stop at EOS, with lengths spread from a few tokens to
`--new_tokens`: `--stop_tokens` token ids end a response (the random model samples one with a
roughly constant chance per step, so lengths are geometric, cut at the cap), and
`--long_tail_rows` responses (default 4 x `--batch`) pass through `--batch` slots with
continuous batching. The engine runs twice from the same keys, with the paged decode
(`--decode_attention`, default "paged") and with the dense one, so both make the same tokens;
HF generate stops at the same ids. One JSON line: paged_tok_s, dense_tok_s, paged_vs_dense
(target >= 1.5 on CPU at 'bench'), hf_tok_s, the length mix, every run's time.
"""  # noqa: E501 (the GPU command is one line)

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

from dvp_jax.cli import BACKENDS, require_backend  # noqa: E402 (after the OpenMP setting)
from dvp_jax.dvp.pruning import DEFAULT_LOG_RHO  # noqa: E402
from dvp_jax.model.config import PRECISIONS, PRESETS  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "preset", "bench", ["bench", *sorted(PRESETS)], "Model: 'bench' or a ModelConfig preset."
)
flags.DEFINE_enum("dtype", "bfloat16", list(PRECISIONS), "Engine dtype.")
flags.DEFINE_integer("batch", 16, "Decode slots (= rows: prompts x group).")
flags.DEFINE_integer("group", 1, "Samples per prompt (G); must divide --batch.")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("prompt_len", 16, "Prompt length in tokens.")
flags.DEFINE_integer(
    "steps_per_sync",
    8,
    "At most this many engine decode steps per dispatch / host check (the RL loop's default).",
)
flags.DEFINE_integer("repeats", 3, "Timed runs per side (interleaved; best counts).")
flags.DEFINE_enum("backend", None, list(BACKENDS), "Refuse to run on another jax backend.")
flags.DEFINE_bool("long_tail", False, "Responses stop at EOS (module docstring): paged vs dense.")
flags.DEFINE_integer("long_tail_rows", 0, "--long_tail: responses (0: 4 x --batch).")
flags.DEFINE_integer(
    "stop_tokens", 24, "--long_tail: this many token ids end a response (ids 3 ... 3 + n - 1)."
)
flags.DEFINE_enum(
    "decode_attention",
    "paged",
    ["paged", "paged_xla"],
    "--long_tail: the new decode (paged_xla: the XLA path on every backend, a fallback).",
)
flags.DEFINE_integer("page_size", 64, "--long_tail: positions per KV page.")

LOG_RHO = DEFAULT_LOG_RHO  # the min-p rule both sides sample with


# Peak memory bandwidth (bytes/s) per accelerator kind (substring of `device_kind`), vendor
# figures; CPU is measured (`cpu_bandwidth`).
BANDWIDTH = {
    "H200": 4.8e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "L4": 3.0e11,
    "TPU v5p": 2.76e12,
    "TPU v5 lite": 8.19e11,
    "TPU v5e": 8.19e11,
    "TPU v4": 1.2e12,
    "TPU v6": 1.64e12,
}


def model_config(size: str):
    from dvp_jax.model import ModelConfig

    if size != "bench":
        return ModelConfig.preset(size)
    # 'tiny' (tied embeddings, rope theta 1e4) scaled up to d 256, 4 layers, vocab 4096.
    dims = dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768)
    return ModelConfig.preset("tiny", vocab_size=4096, max_position_embeddings=1024, **dims)


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


def cpu_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of a large array copy (read + write counted), best of `repeats`."""
    import numpy as np

    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def device_bandwidth(device) -> tuple[float, str]:
    """(bytes/s, where the figure comes from) for a JAX device."""
    if device.platform == "cpu":
        return cpu_bandwidth(), "measured: numpy copy of 256 MiB (read + write)"
    kind = device.device_kind
    for name, bw in BANDWIDTH.items():
        if name.lower() in kind.lower():
            return bw, f"table: {name}"
    raise ValueError(f"no memory bandwidth known for device kind {kind!r}; add it to BANDWIDTH")


def roofline(engine, batch: int, context: float) -> float:
    """Bytes a decode step must read at least: the rollout weights (the embedding table only
    when it is also the unembedding) plus `batch` slots' KV cache of `context` positions."""
    import jax
    import numpy as np

    cfg = engine.model_cfg
    weights = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(engine.params):
        name = jax.tree_util.keystr(path)
        if "embed" in name and "blocks" not in name and not cfg.tie_embeddings:
            continue  # untied: decode gathers `batch` rows of the embedding, reads lm_head
        weights += leaf.size * leaf.dtype.itemsize
    cache_item = np.dtype(engine.policy.cache_dtype).itemsize
    kv = batch * context * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * cache_item
    return weights + kv


def long_tail(cfg, path, engine_config, hf_generate) -> dict:
    """The `--long_tail` comparison (module docstring): paged and dense engines on the same
    weights and keys, HF generate beside them."""
    import jax
    import numpy as np
    from flax import nnx

    from dvp_jax.model import DTypePolicy
    from dvp_jax.model.hf_import import load_hf
    from dvp_jax.rollout.engine import RolloutEngine
    from dvp_jax.rollout.offline import generate_rollouts
    from dvp_jax.sharding import ROLLOUT_RULES, MeshConfig, Sharder, make_mesh

    rows = FLAGS.long_tail_rows or 4 * FLAGS.batch
    # Prompts of ids past the stop tokens, all `--prompt_len` long (HF generates in one batch).
    low = 3 + FLAGS.stop_tokens
    prompts = np.random.default_rng(0).integers(low, cfg.vocab_size, (rows, FLAGS.prompt_len))
    prompts = prompts.tolist()
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    model = load_hf(path, DTypePolicy.named(FLAGS.dtype), Sharder(mesh, ROLLOUT_RULES))
    engines = {
        mode: RolloutEngine(
            cfg,
            engine_config(decode_attention=mode, page_size=FLAGS.page_size),
            params=nnx.state(model),
            mesh=mesh,
        )
        for mode in (FLAGS.decode_attention, "dense")
    }
    made = {}

    def run(mode):
        batch = generate_rollouts(
            engines[mode], prompts, 1, jax.random.key(7), steps_per_sync=FLAGS.steps_per_sync
        )
        made[mode] = batch
        return batch

    generated = {}

    def run_hf():
        generated["hf"] = hf_generate(prompts)

    fns = {"paged": lambda: run(FLAGS.decode_attention), "dense": lambda: run("dense")}
    times = run_times({**fns, "hf": run_hf}, FLAGS.repeats)
    paged, dense = made[FLAGS.decode_attention], made["dense"]
    lengths = dense.response_lengths
    # bf16 sampling: a response whose tokens differ took another branch at a near-tie (the two
    # decodes round attention differently) and is its own long-tailed sample from then on.
    same = np.all(paged.tokens == dense.tokens, axis=1)
    made = {"paged": int(paged.response_lengths.sum()), "dense": int(lengths.sum())}
    best = {name: min(t) for name, t in times.items()}
    rate = {name: made[name] / best[name] for name in made}
    return {
        "paged_tok_s": round(rate["paged"], 1),
        "dense_tok_s": round(rate["dense"], 1),
        "paged_vs_dense": round(rate["paged"] / rate["dense"], 2),
        "hf_tok_s": round(generated["hf"] / best["hf"], 1),
        "paged_vs_hf": round(rate["paged"] / (generated["hf"] / best["hf"]), 2),
        "decode_attention": FLAGS.decode_attention,
        "paged_impl": engines[FLAGS.decode_attention].paged_impl,
        "responses": rows,
        "tokens": made,
        "hf_tokens": generated["hf"],
        "responses_equal": int(same.sum()),
        "length_mean": round(float(lengths.mean()), 1),
        "length_min_p50_p90_max": [int(np.percentile(lengths, q)) for q in (0, 50, 90, 100)],
        "runs_s": {name: [round(x, 3) for x in t] for name, t in times.items()},
    }


def main(argv):
    del argv
    require_backend(FLAGS.backend)
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

    cfg = model_config(FLAGS.preset)
    b, g, m, p = FLAGS.batch, FLAGS.group, FLAGS.new_tokens, FLAGS.prompt_len
    if g < 1 or b % g:
        raise app.UsageError(f"--group={g} must be >= 1 and divide --batch={b}")
    n_prompts = b // g
    prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(n_prompts, p)).tolist()
    cuda = torch.cuda.is_available()
    hf_device, hf_dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hf")
        save_hf(Transformer(cfg, TRAIN_POLICY, rngs=nnx.Rngs(0)), path)

        # --- Hugging Face transformers (PyTorch: CPU float32, or CUDA bfloat16). ---
        hf = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=hf_dtype).to(hf_device).eval()
        input_ids = torch.tensor(prompts, device=hf_device)
        # Our engine's sampling rule (temperature 1, min-p at LOG_RHO), m new tokens at most.
        sample = dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=math.exp(LOG_RHO),
            max_new_tokens=m,
            pad_token_id=0,
        )

        def run_hf():
            with torch.no_grad():
                out = hf.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    min_new_tokens=m,
                    num_return_sequences=g,
                    **sample,
                )
            if cuda:
                torch.cuda.synchronize()
            assert out.shape == (b, p + m), out.shape

        if FLAGS.long_tail:
            stop = list(range(3, 3 + FLAGS.stop_tokens))

            def hf_generate(rows):
                """Tokens HF generates for `rows` (one batch per length, stopping at `stop`)."""
                made = 0
                with torch.no_grad():
                    for length in sorted({len(r) for r in rows}):
                        ids = torch.tensor([r for r in rows if len(r) == length], device=hf_device)
                        out = hf.generate(
                            ids, attention_mask=torch.ones_like(ids), eos_token_id=stop, **sample
                        )[:, length:]
                        ended = torch.isin(out, torch.tensor(stop, device=out.device))
                        # Tokens up to and including the first stop token, else all m.
                        first = torch.where(ended.any(1), ended.int().argmax(1) + 1, out.shape[1])
                        made += int(first.sum())
                if cuda:
                    torch.cuda.synchronize()
                return made

            def engine_config(**kw):
                return EngineConfig(
                    dtype=FLAGS.dtype,
                    max_concurrent_decodes=b,
                    max_prefill_length=p,
                    max_decode_length=m,
                    log_rho=LOG_RHO,
                    stop_tokens=tuple(stop),
                    **kw,
                )

            result = long_tail(cfg, path, engine_config, hf_generate)
            result.update(
                device=jax.devices()[0].device_kind,
                preset=FLAGS.preset,
                engine_dtype=FLAGS.dtype,
                hf_device=hf_device,
                slots=b,
                max_new_tokens=m,
                prompt_len=p,
                steps_per_sync=FLAGS.steps_per_sync,
                cpus=os.cpu_count(),
                jax=jax.__version__,
            )
            print(json.dumps(result))
            sys.stdout.flush()
            return

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
                engine, prompts, g, jax.random.key(next(keys)), steps_per_sync=FLAGS.steps_per_sync
            )
            assert (batch.response_lengths == m).all()

        times = run_times({"hf": run_hf, "engine": run_engine}, FLAGS.repeats)
        hf_s, engine_s = min(times["hf"]), min(times["engine"])

    tokens = b * m
    steps = m  # b rows in b slots: every slot decodes m steps once
    bandwidth, bandwidth_source = device_bandwidth(jax.devices()[0])
    step_bytes = roofline(engine, b, p + m / 2)  # mean live context over the decode
    roofline_tok_s = b * bandwidth / step_bytes
    result = {
        "engine_tok_s": round(tokens / engine_s, 1),
        "hf_tok_s": round(tokens / hf_s, 1),
        "ratio_vs_hf": round(hf_s / engine_s, 2),
        "ms_per_step": round(1e3 * engine_s / steps, 3),
        "roofline_tok_s": round(roofline_tok_s, 1),
        "frac_of_roofline": round(tokens / engine_s / roofline_tok_s, 4),
        "bytes_per_step": int(step_bytes),
        "bandwidth_Bps": float(f"{bandwidth:.3g}"),
        "bandwidth_source": bandwidth_source,
        "device": jax.devices()[0].device_kind,
        "preset": FLAGS.preset,
        "engine_dtype": FLAGS.dtype,
        "hf_dtype": str(hf_dtype).replace("torch.", ""),
        "hf_device": hf_device,
        "batch": b,
        "group": g,
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
