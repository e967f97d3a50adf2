"""Train-step throughput, MFU, compile time and peak memory of the jitted DVP-RLOO step.

Times `train.step.rl_update` (forward, chunked pruned log-probs, MIS+DVP loss, backward, AdamW)
jitted by `step.jit_step` with donated state, on one device and a random batch. One JSON line
per configuration: tok_s (batch x seq per median step), mfu (6 N_matmul + 6 L T n h FLOPs per
token over the device's dense bf16 peak on GPU/TPU, a measured `jnp.dot` on CPU; recompute not
counted), compile_s, peak memory (the allocator's peak, else argument + output + temp less
donated: `peak_memory_source`) and temp_gib.

  python benchmarks/train_step.py [--quick]        # CPU: "d128" and "50m"
  python benchmarks/train_step.py --packing [--quick]   # packed vs padded rows, long tail
  python benchmarks/train_step.py --preset d256 --compile-layers 2,24   # compile vs depth
  python benchmarks/train_step.py --preset qwen3_0_6b --policy mixed_bf16 --batch 8 --seq 4096 --remat save_dots_no_batch

The last is the GPU target (remat is needed unless attention is fused). `--preset`: a size
in SIZES ("d128", "d256", "50m") or a `ModelConfig` preset; `--layers` overrides the depth.

`--packing` times the update as the trainer runs it (`packing.pack` rows, `rl_update` with its
micro-batches) on one long-tailed mix of response lengths (`length_mix`: most short, a few at
`--max_response`), laid out twice: padded (one sequence per row) and packed (several per row,
empty micro-batches skipped), and prints the real tokens (prompt + response) per second of each
and their ratio, measured alternately in one process, and how far the two layouts' loss, grad
norm and training perplexity differ on the first update (one compiled program each: float
rounding, e.g. bf16 attention under mixed_bf16).
"""  # noqa: E501 (the GPU command is one line)

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dvp_jax.cli import BACKENDS, require_backend
from dvp_jax.dvp.losses import LossConfig
from dvp_jax.model import ModelConfig, Transformer
from dvp_jax.model.config import PRESETS, REMAT_POLICIES, TRAIN_PRECISIONS, DTypePolicy
from dvp_jax.plan import length_mix
from dvp_jax.rollout.offline import RolloutBatch
from dvp_jax.sharding import Sharder, count_params
from dvp_jax.train import packing
from dvp_jax.train import step as step_lib
from dvp_jax.train.batch import RLBatch
from dvp_jax.train.state import init_train_state, make_optimizer

# Benchmark sizes, all with tied embeddings; their names differ from every ModelConfig preset.
# name: (vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff)
_SIZES = {
    "d128": (64, 128, 2, 4, 2, 32, 256),
    # The width of the compile-time-vs-depth check (2 and 24 layers, same width).
    "d256": (8192, 256, 2, 4, 2, 64, 1024),
    "50m": (8192, 512, 12, 8, 4, 64, 2048),
}
SIZES = {name: ModelConfig(*dims, tie_embeddings=True) for name, dims in _SIZES.items()}
assert not set(SIZES) & set(PRESETS), "a benchmark size may not reuse a ModelConfig preset name"
PRESET_NAMES = tuple(SIZES) + tuple(PRESETS)
# Default (batch rows, sequence length) of a run: CPU sizes for the small configurations, the
# GPU target (8 x 4096) for the Qwen3 presets.
DEFAULT_SHAPE = {"d128": (64, 32), "d256": (8, 256), "50m": (8, 128), "tiny": (8, 32)}
QWEN_SHAPE = (8, 4096)

# Dense (no sparsity) bf16 tensor-core / MXU peak per device, FLOP/s, matched as lower-case
# substrings of `jax.devices()[0].device_kind` in this order (more specific names first).
# NVIDIA datasheets give bf16 "with sparsity"; dense is half. H100 SXM: 1,979 sparse -> 989;
# H100 PCIe: 1,513 -> 756; H200 (SXM): same tensor cores as H100 SXM, 1,979 -> 989 (the
# datasheet figure, not the 790 TFLOP/s sometimes quoted); H200 NVL: 1,671 -> 835;
# A100 (SXM and PCIe): 312 dense. Cloud TPU system-architecture pages: v5p 459, v5e 197,
# v4 275, v6e 918 per chip. JAX names v5p "TPU v5" and v5e "TPU v5 lite".
PEAK_BF16 = (
    ("h200 nvl", 835e12, "NVIDIA H200 NVL datasheet, 1,671 TFLOP/s sparse / 2"),
    ("h200", 989e12, "NVIDIA H200 datasheet (SXM), 1,979 TFLOP/s sparse / 2"),
    ("h100 pcie", 756e12, "NVIDIA H100 datasheet (PCIe), 1,513 TFLOP/s sparse / 2"),
    ("h100", 989e12, "NVIDIA H100 datasheet (SXM), 1,979 TFLOP/s sparse / 2"),
    ("a100", 312e12, "NVIDIA A100 datasheet, 312 TFLOP/s dense"),
    ("tpu v5 lite", 197e12, "Cloud TPU v5e docs, 197 TFLOP/s per chip"),
    ("tpu v5e", 197e12, "Cloud TPU v5e docs, 197 TFLOP/s per chip"),
    ("tpu v5p", 459e12, "Cloud TPU v5p docs, 459 TFLOP/s per chip"),
    ("tpu v5", 459e12, "Cloud TPU v5p docs, 459 TFLOP/s per chip"),
    ("tpu v6 lite", 918e12, "Cloud TPU v6e docs, 918 TFLOP/s per chip"),
    ("tpu v6e", 918e12, "Cloud TPU v6e docs, 918 TFLOP/s per chip"),
    ("tpu v4", 275e12, "Cloud TPU v4 docs, 275 TFLOP/s per chip"),
)
GiB = 2**30


def device_peak(device_kind: str) -> tuple[float | None, str]:
    """(dense bf16 FLOP/s, source) of a device kind from `PEAK_BF16`, or (None, reason)."""
    kind = device_kind.lower()
    for key, flops, source in PEAK_BF16:
        if key in kind:
            return flops, source
    return None, f"device kind {device_kind!r} not in PEAK_BF16 (add its datasheet peak)"


def model_config(preset: str, layers: int | None) -> ModelConfig:
    """The benchmark size or ModelConfig preset `preset`, with `layers` overriding the depth."""
    if preset in SIZES:
        cfg = SIZES[preset]
    elif preset in PRESETS:
        cfg = PRESETS[preset]
    else:
        raise ValueError(f"--preset {preset!r} is unknown; allowed: {PRESET_NAMES}")
    return cfg if layers is None else dataclasses.replace(cfg, n_layers=layers)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def matmul_peak_flops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Measured FLOP/s of one jitted n x n x n `jnp.dot` in `dtype` (the CPU MFU denominator)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    return 2 * n**3 / _median_time(lambda: dot(a, b), repeats)


def train_flops_per_token(cfg: ModelConfig, length: int) -> float:
    """Model FLOPs per trained token: 6 N_matmul + causal attention 6 L T n_heads head_dim.

    N_matmul counts the matmul weights of the blocks (q, k, v, o, gate, up, down) and the
    unembedding [d, V]; the embedding lookup and the norms do no matmul. Attention: q.k and p.v
    are 2 T n h multiply-adds per token and layer each, halved by the causal mask, x3 for
    forward + backward.
    """
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    per_layer = 2 * d * n * h + 2 * d * k * h + 3 * d * f
    n_matmul = cfg.n_layers * per_layer + d * cfg.vocab_size
    return 6 * n_matmul + 6 * cfg.n_layers * length * n * h


def _jit_update(graphdef, optimizer, cfg: ModelConfig, state_sh):
    """`rl_update` (mis_dvp, one micro-batch) jitted by `jit_step` on one device."""
    return step_lib.jit_step(
        functools.partial(
            step_lib.rl_update,
            graphdef=graphdef,
            optimizer=optimizer,
            loss_cfg=LossConfig.preset("mis_dvp"),
            chunk_size=min(8192, cfg.vocab_size),
            micro_batches=1,
        ),
        state_sh,
        None,
        Sharder(),
    )


def _build(cfg: ModelConfig, policy: str, remat: str):
    """(model, state, step_fn): a random model, its train state and the `jit_step`-ed update.

    The state holds its own copy of the parameters: drop `model` once it is counted.
    """
    policy_ = DTypePolicy.named(policy).for_platform(jax.default_backend())
    model = Transformer(cfg, policy_, rngs=nnx.Rngs(0), remat=remat)
    optimizer = make_optimizer(1e-4, 0, 0.0, 1.0)
    graphdef, state, state_sh = init_train_state(model, optimizer, 0, Sharder())
    fn = _jit_update(graphdef, optimizer, cfg, state_sh)
    return model, state, fn


def _batch(cfg: ModelConfig, rows: int, length: int) -> RLBatch:
    """A random `RLBatch` of `rows` x `length` tokens: a quarter prompt, then response tokens
    with behaviour log-probs in [-4, -0.5] (the values do not change the step's cost)."""
    k_tokens, k_logp, k_adv = jax.random.split(jax.random.key(0), 3)
    targets = (rows, length - 1)
    response = jnp.broadcast_to(jnp.arange(length - 1) >= length // 4 - 1, targets)
    logp = jnp.where(response, -jax.random.uniform(k_logp, targets, minval=0.5, maxval=4.0), 0.0)
    return RLBatch(
        tokens=jax.random.randint(k_tokens, (rows, length), 3, cfg.vocab_size, jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
        segment_ids=jnp.ones((rows, length), jnp.int32),
        response_mask=response,
        behaviour_logp=logp,
        behaviour_logp_full=logp,
        behaviour_pruned_mass=jnp.zeros(targets),
        behaviour_safe_size=jnp.full(targets, float(cfg.vocab_size)),
        advantages=jax.random.normal(k_adv, (rows,)),
        old_logp=jnp.zeros(targets),
        old_in_safe=jnp.ones(targets, bool),
    )


def _compile(fn, state, batch) -> tuple[object, float]:
    t = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    return compiled, time.perf_counter() - t


def _memory(compiled) -> dict:
    """Peak memory: the device's allocator peak where it has one, else the executable's."""
    out = {}
    analysis = compiled.memory_analysis()
    if analysis is not None:
        out["temp_gib"] = analysis.temp_size_in_bytes / GiB
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["peak_memory_gib"] = stats["peak_bytes_in_use"] / GiB
        out["peak_memory_source"] = "memory_stats.peak_bytes_in_use"
    elif analysis is not None:
        a = analysis
        total = a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes
        out["peak_memory_gib"] = (total - a.alias_size_in_bytes) / GiB
        out["peak_memory_source"] = "memory_analysis argument+output+temp-alias"
    return out


def measure(
    cfg: ModelConfig,
    rows: int,
    length: int,
    repeats: int,
    peak: float | None,
    *,
    policy: str = "float32",
    remat: str = "none",
    scaling: bool = False,
) -> dict:
    """Compile, then time the step on a random batch of `rows` x `length` tokens.

    With `scaling`, also times `2 * rows` rows and reports the time ratio (expect <= 2.2x).
    """
    model, state, fn = _build(cfg, policy, remat)
    holder = {"state": state}
    out = {"params": count_params(nnx.state(model)), "tokens_per_step": rows * length}
    del model
    times = {}
    for scale in (1, 2) if scaling else (1,):
        batch = _batch(cfg, rows * scale, length)
        compiled, compile_s = _compile(fn, holder["state"], batch)
        if scale == 1:
            out["compile_s"] = compile_s

        def run(compiled=compiled, batch=batch):
            holder["state"], metrics = compiled(holder["state"], batch)
            return metrics["loss"]

        jax.block_until_ready(run())  # warm-up
        times[scale] = _median_time(run, repeats)
        if scale == 1:
            out |= _memory(compiled)
    tokens = rows * length
    out["step_s"] = times[1]
    out["tok_s"] = tokens / times[1]
    if peak:
        out["mfu"] = train_flops_per_token(cfg, length) * tokens / times[1] / peak
    if scaling:
        out["2x_tokens_time_ratio"] = times[2] / times[1]
    return out


def compile_seconds(cfg: ModelConfig, rows: int, length: int, policy: str, remat: str) -> float:
    """Lower + compile seconds of the step, from abstract shapes (nothing is allocated)."""
    optimizer = make_optimizer(1e-4, 0, 0.0, 1.0)
    policy_ = DTypePolicy.named(policy).for_platform(jax.default_backend())
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: Transformer(cfg, policy_, rngs=nnx.Rngs(0), remat=remat))
    )
    state = jax.eval_shape(
        lambda: init_train_state(
            Transformer(cfg, policy_, rngs=nnx.Rngs(0), remat=remat), optimizer, 0, Sharder()
        )[1]
    )
    fn = _jit_update(graphdef, optimizer, cfg, None)
    batch = jax.eval_shape(lambda: _batch(cfg, rows, length))
    return _compile(fn, state, batch)[1]


def _long_tail_rollouts(
    vocab: int, n: int, prompt: int, max_response: int, mean: float, at_cap: int
):
    """`n` random rollouts of `prompt` prompt tokens and long-tailed response lengths of mean
    `mean` (`length_mix.lengths_from_mean`, capped at `max_response`), the `at_cap` longest
    then set to the cap (responses cut at the maximum)."""
    rng = np.random.default_rng(0)
    lengths = length_mix.lengths_from_mean(mean, n, max_response)
    lengths[np.argsort(lengths)[n - at_cap :]] = max_response
    t = prompt + max_response
    cols = np.arange(t)[None, :]
    prompt_mask = np.broadcast_to(cols < prompt, (n, t))
    response_mask = ~prompt_mask & (cols < prompt + lengths[:, None])
    logp = np.where(response_mask, -rng.uniform(0.5, 4.0, (n, t)), 0.0).astype(np.float32)
    zeros = np.zeros((n,), np.int32)
    return RolloutBatch(
        tokens=rng.integers(3, vocab, (n, t)).astype(np.int32),
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        behaviour_logp=logp,
        behaviour_logp_full=logp,
        behaviour_pruned_mass=np.zeros((n, t), np.float32),
        behaviour_safe_size=np.full((n, t), vocab, np.int32),
        prompt_index=zeros,
        group_index=zeros,
        prompt_lengths=np.full((n,), prompt, np.int32),
        response_lengths=lengths.astype(np.int32),
        finished=np.ones((n,), bool),
    )


def measure_packing(
    cfg: ModelConfig,
    sequences: int,
    prompt: int,
    max_response: int,
    mean: float,
    at_cap: int,
    micro_batches: int,
    repeats: int,
    policy: str,
    remat: str,
) -> dict:
    """Real tokens/s of the update on packed rows and on padded rows (one sequence per row), the
    same sequences, timed alternately (module docstring)."""
    rollouts = _long_tail_rollouts(cfg.vocab_size, sequences, prompt, max_response, mean, at_cap)
    advantages = np.random.default_rng(1).normal(size=sequences).astype(np.float32)
    real = int(rollouts.prompt_lengths.sum() + rollouts.response_lengths.sum())
    policy_ = DTypePolicy.named(policy).for_platform(jax.default_backend())
    model = Transformer(cfg, policy_, rngs=nnx.Rngs(0), remat=remat)
    optimizer = make_optimizer(1e-4, 0, 0.0, 1.0)
    graphdef, state, state_sh = init_train_state(model, optimizer, 0, Sharder())
    del model
    runs = {}
    for name, packed in (("padded", False), ("packed", True)):
        layout = packing.make_layout(
            sequences=sequences,
            longest=prompt + max_response,
            row_length=0,
            micro_batches=micro_batches,
            packed=packed,
        )
        batch = jax.tree.map(jnp.asarray, packing.pack(rollouts, advantages, layout))
        fn = step_lib.jit_step(
            functools.partial(
                step_lib.rl_update,
                graphdef=graphdef,
                optimizer=optimizer,
                loss_cfg=LossConfig.preset("mis_dvp"),
                chunk_size=min(8192, cfg.vocab_size),
                micro_batches=layout.micro_batches,
                sequences_per_row=layout.sequences_per_row if packed else None,
            ),
            state_sh,
            None,
            Sharder(),
        )
        compiled, compile_s = _compile(fn, state, batch)
        filled = int((batch.segment_ids > 0).any(axis=1).sum())
        split = packing.micro_batch_split(batch.response_mask, layout.micro_batches)
        active = int(split.any(axis=(1, 2)).sum())
        runs[name] = dict(compiled=compiled, batch=batch, times=[], compile_s=compile_s)
        runs[name]["info"] = dict(rows=layout.rows, rows_filled=filled, micro_batches_run=active)
    # The same update both ways from the same state (the check that packing changes no value:
    # on a GPU this runs cuDNN's packed-segment mask against its padded key lengths).
    first = {
        name: jax.device_get(run["compiled"](jax.tree.map(jnp.copy, state), run["batch"])[1])
        for name, run in runs.items()
    }
    agree = {
        f"packed_vs_padded_{key}_rel_diff": float(
            abs(first["packed"][key] - first["padded"][key]) / max(abs(first["padded"][key]), 1e-30)
        )
        for key in ("loss", "grad_norm", "training_ppl")
    }
    holder = {"state": state}

    def step(run):
        holder["state"], metrics = run["compiled"](holder["state"], run["batch"])
        return metrics["loss"]

    for run in runs.values():
        jax.block_until_ready(step(run))  # warm-up
    for _ in range(repeats):  # alternately, so both see the same machine load
        for run in runs.values():
            t = time.perf_counter()
            jax.block_until_ready(step(run))
            run["times"].append(time.perf_counter() - t)
    out = {
        "sequences": sequences,
        "row_length": prompt + max_response,
        "real_tokens": real,
        "mean_response": float(rollouts.response_lengths.mean()),
        "max_response": int(rollouts.response_lengths.max()),
        "responses_at_cap": int((rollouts.response_lengths == max_response).sum()),
    }
    for name, run in runs.items():
        seconds = float(np.median(run["times"]))
        out |= {f"{name}_{k}": v for k, v in run["info"].items()}
        out |= {f"{name}_step_s": seconds, f"{name}_tok_s": real / seconds}
        out[f"{name}_compile_s"] = run["compile_s"]
    out["packed_over_padded_tok_s"] = out["packed_tok_s"] / out["padded_tok_s"]
    return out | agree


def _round(result: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats (without --preset also smaller batches)",
    )
    parser.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default=None,
        help="one configuration (default: the pair 'd128' and '50m')",
    )
    parser.add_argument("--policy", choices=TRAIN_PRECISIONS, default="float32")
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="none")
    parser.add_argument("--batch", type=int, default=None, help="rows per step")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument(
        "--compile-layers",
        default=None,
        metavar="L1,L2,...",
        help="only compile the step (abstract shapes) at these depths, in interleaved rounds "
        "(2 with --quick, else 3), and report each depth's fastest",
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help="refuse to run on another backend"
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="packed vs padded rows on a long-tailed length mix (default preset d256)",
    )
    parser.add_argument("--sequences", type=int, default=64, help="--packing: responses")
    parser.add_argument("--prompt", type=int, default=16, help="--packing: prompt tokens")
    parser.add_argument("--max_response", type=int, default=240, help="--packing: the cap")
    parser.add_argument("--mean_response", type=float, default=48.0, help="--packing: mean")
    parser.add_argument("--micro_batches", type=int, default=8, help="--packing: per update")
    parser.add_argument(
        "--at_cap", type=int, default=3, help="--packing: the longest responses set to the cap"
    )
    args = parser.parse_args(argv)
    require_backend(args.backend)
    repeats = 3 if args.quick else 5
    backend = jax.default_backend()
    device = jax.devices()[0]
    result = {
        "backend": backend,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "devices_used": 1,
        "policy": args.policy,
        "remat": args.remat,
    }
    compute_dtype = DTypePolicy.named(args.policy).compute_dtype
    if args.packing:
        name = args.preset or "d256"
        cfg = model_config(name, args.layers)
        result |= {"preset": name, "n_layers": cfg.n_layers, "d_model": cfg.d_model}
        result |= measure_packing(
            cfg,
            args.sequences,
            args.prompt,
            args.max_response,
            args.mean_response,
            args.at_cap,
            args.micro_batches,
            3 if args.quick else repeats,
            args.policy,
            args.remat,
        )
        print(json.dumps(_round(result)))
        return
    peak = None
    if args.compile_layers:
        pass  # nothing runs: no MFU, no peak
    elif backend == "cpu":
        peak = matmul_peak_flops(1024 if args.quick else 2048, repeats, compute_dtype)
        result["matmul_peak_gflops"] = peak / 1e9
        result["peak_source"] = f"measured {jnp.dtype(compute_dtype).name} jnp.dot"
    else:
        peak, result["peak_source"] = device_peak(device.device_kind)
        if peak:
            result["peak_tflops"] = peak / 1e12

    if args.preset is None:  # the default pair "d128" and "50m", with the 2x-tokens ratio
        if any(v is not None for v in (args.batch, args.seq, args.layers, args.compile_layers)):
            parser.error("--batch, --seq, --layers and --compile-layers need --preset")
        for name, rows, length in (
            ("d128", 16 if args.quick else 64, 32),
            ("50m", 2 if args.quick else 8, 128),
        ):
            cfg = model_config(name, None)
            m = measure(
                cfg,
                rows,
                length,
                repeats,
                peak,
                policy=args.policy,
                remat=args.remat,
                scaling=True,
            )
            result |= {f"{name}_{k}": v for k, v in m.items()}
        print(json.dumps(_round(result)))
        return

    cfg = model_config(args.preset, args.layers)
    rows, length = DEFAULT_SHAPE.get(args.preset, QWEN_SHAPE)
    rows = rows if args.batch is None else args.batch
    length = length if args.seq is None else args.seq
    if rows < 1 or length < 4:
        parser.error(
            f"--batch must be >= 1 and --seq >= 4 (a quarter is prompt), got {rows}, {length}"
        )
    result |= {"preset": args.preset, "n_layers": cfg.n_layers, "d_model": cfg.d_model}
    result |= {"batch": rows, "seq": length}
    if args.compile_layers:
        depths = [int(x) for x in args.compile_layers.split(",")]
        # Interleaved rounds, the fastest of each depth: the first compile of a process also
        # pays one-off costs (JAX and XLA warm-up) that are not the step's.
        seconds = {n: [] for n in depths}
        for _ in range(2 if args.quick else 3):
            for n in depths:
                c = dataclasses.replace(cfg, n_layers=n)
                seconds[n].append(compile_seconds(c, rows, length, args.policy, args.remat))
        for n in depths:
            result[f"compile_s_{n}_layers"] = min(seconds[n])
        result["compile_s_rounds"] = {n: [round(x, 2) for x in v] for n, v in seconds.items()}
        result["compile_ratio_deepest_to_shallowest"] = (
            result[f"compile_s_{max(depths)}_layers"] / result[f"compile_s_{min(depths)}_layers"]
        )
        del result["n_layers"]
    else:
        result |= measure(cfg, rows, length, repeats, peak, policy=args.policy, remat=args.remat)
    print(json.dumps(_round(result)))


if __name__ == "__main__":
    main()
