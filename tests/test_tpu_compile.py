"""The trainer's and the engine's programs compile for TPU topologies, from this CPU host.

`dvp_jax.aot` builds the programs a run jits (same builders, shardings and shapes) and the
real TPU compiler (libtpu, installed by `make install`) compiles them for a v5p topology of 4
devices (one host) or 8 (two hosts). The configs are small; what they cover is what decides
whether a program compiles on a pod: every trainer policy, every attention kernel `auto` picks
on TPU (splash for 16-bit compute with T and h multiples of 128, the explicit path otherwise),
every rollout precision, tensor parallelism 1 and 2, and meshes with fsdp > 1. Each program is
compiled once (a test's checks share its compiles); `python -m dvp_jax.aot` runs in one
subprocess, on the tiny config on two hosts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dvp_jax.plan import aot, compiled
from dvp_jax.plan.specs import train_specs
from dvp_jax.plan.topology import CHIP_HBM_GIB, chip_of, topology_devices
from dvp_jax.train.config import ExperimentConfig, default_config

_GIB = 1024**3


def _config(
    *,
    precision: str,
    mesh: tuple[int, int, int],
    tensor_parallel: int,
    rollout_dtype: str,
    head_dim: int = 128,
    micro_batches: int = 1,
    tie: bool = False,
    prompt_len: int = 128,
    decode_len: int = 128,
    sft_steps: int = 0,
    prompts: int = 4,
    attention_impl: str = "auto",
    updates_per_batch: int = 1,
) -> ExperimentConfig:
    """A 2-layer model (d 256, 4 query / 2 KV heads) on a 128-token vocabulary-sized test."""
    c = default_config("mis_dvp")
    c.model.d_model = 256
    c.model.head_dim = head_dim
    c.model.n_heads = 4
    c.model.n_kv_heads = 2
    c.model.d_ff = 512
    c.model.n_layers = 2
    c.model.vocab_size = 512
    c.model.tie_embeddings = tie
    c.model.max_position_embeddings = 1024
    c.data.max_prompt_len = prompt_len
    c.rollout.max_decode_length = decode_len
    c.rollout.max_concurrent_decodes = 8
    c.rollout.tensor_parallel = tensor_parallel
    c.rollout.dtype = rollout_dtype
    c.train.prompts_per_step = prompts
    c.train.attention_impl = attention_impl
    c.train.group_size = 2
    c.train.micro_batches = micro_batches
    c.train.updates_per_batch = updates_per_batch
    if updates_per_batch > 1:
        c.loss.ppo_clip_eps = 0.2
    c.train.precision = precision
    c.train.chunk_size = 256
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
    c.sft.steps = sft_steps
    c.sft.batch_size = 8
    return ExperimentConfig.from_config_dict(c, 512)


def _compile(cfg, topology: str, programs: tuple[str, ...] = ()) -> dict[str, compiled.Program]:
    programs = aot.compile_config(cfg, topology, programs=programs, log=lambda line: None)
    by_name = {p.name: p for p in programs}
    bad = compiled.failures(programs, CHIP_HBM_GIB[chip_of(topology)], 0.9)
    print(compiled.table(programs, CHIP_HBM_GIB[chip_of(topology)]))
    assert bad == [], bad
    return by_name


def _one(programs: dict[str, compiled.Program], prefix: str) -> compiled.Program:
    found = [p for name, p in programs.items() if name.startswith(prefix)]
    assert len(found) == 1, (prefix, sorted(programs))
    return found[0]


def test_mixed_bf16_with_splash_on_a_tensor_parallel_mesh_compiles():
    """mixed_bf16, head_dim 128, T = 256: `auto` runs splash (packed segment ids) in the update,
    in the PPO old policy's forward and in prefill, on a (1, 2, 2) mesh and a tensor-parallel-2
    engine. Before splash ran under shard_map both failed ("Mosaic kernels cannot be
    automatically partitioned"). An untied unembedding with 2 micro-batches failed the TPU
    compiler's while-loop-all-reduce-code-motion RET_CHECK until the project turned that pass
    off for TPU programs (`sharding.TPU_COMPILER_OPTIONS`)."""
    cfg = _config(
        precision="mixed_bf16",
        mesh=(1, 2, 2),
        tensor_parallel=2,
        rollout_dtype="bfloat16_fp8kv_fp8w",
        micro_batches=2,
        updates_per_batch=2,
    )
    programs = _compile(cfg, "v5p:2x2x1")
    expected = {"rl_update", "logprobs", "engine/init_state"}
    assert expected <= set(programs)
    update, forward = programs["rl_update"], programs["logprobs"]
    prefill = _one(programs, "engine/prefill")
    assert update.mosaic_kernels > 0 and forward.mosaic_kernels > 0 and prefill.mosaic_kernels
    # The same micro-batches, with and without the backward pass: the update's dots outside
    # splash (which gives no FLOP count) are the forward's and twice them for the gradients.
    assert update.flops == pytest.approx(3 * forward.flops, rel=0.15)
    decode = _one(programs, "engine/decode_loop")
    assert decode.flops > 0 and prefill.flops > 0


def test_float32_on_an_fsdp_mesh_compiles_without_a_kernel_and_decode_does_not_copy_the_cache():
    """float32 trainer (explicit attention: no Mosaic kernel) on a (1, 4, 1) mesh, a bf16
    engine with 8 slots x 512 positions at tensor parallel 1 on the first device. The update
    and the weight sync come from the config at T = 256, the engine's programs from the same
    config at T = 512 (compiling the float32 update takes 14 s at T = 256 and 21 s at 512 on a
    2-core host, and nothing checked here needs it longer). The decode loop's temporaries stay
    far below its KV cache: with the cache laid out heads first on TPU the compiler copied k
    and v in and out of the loop (temporaries = 0.95 of the decode state), which is what ran
    the paper config's decode out of HBM; positions first (TPU's layout,
    `kv_cache.cache_layout`) leaves ~0.35. The paged pool (the default) is positions first for
    the same reason (`model/paged.py`)."""
    fsdp = dict(precision="float32", mesh=(1, 4, 1), tensor_parallel=1, rollout_dtype="bfloat16")
    programs = _compile(_config(**fsdp), "v5p:2x2x1", programs=("rl_update", "weight_sync"))
    assert set(programs) == {"rl_update", "weight_sync/on_device"}
    assert programs["rl_update"].mosaic_kernels == 0
    assert programs["rl_update"].flops > 0
    long = _config(**fsdp, prompt_len=256, decode_len=256)
    programs |= _compile(long, "v5p:2x2x1", programs=("engine/",))
    # The engine is one (tensor) row of the trainer's mesh: the sync is an all-gather over
    # fsdp on the devices, each chip receiving the 3/4 of the weights it lacks (the small norm
    # vectors are not split by the trainer, so a little less).
    sync = programs["weight_sync/on_device"]
    assert 0.72 * sync.output < sync.moved <= 0.75 * sync.output
    state = programs["engine/init_state"].output  # the decode state: the cache and a few rows
    decode = _one(programs, "engine/decode_loop")  # paged: the Pallas kernel, one program
    assert decode.mosaic_kernels == 1
    print(f"decode temp / decode state = {decode.temp / state:.2f}")
    assert decode.temp < 0.5 * state, (decode.temp, state)


def test_paged_decode_kernel_compiles_with_tensor_parallelism_above_the_kv_heads():
    """A bf16 engine at tensor parallel 4 on v5p:2x2x1 with 2 KV heads of 128 (4 query heads):
    4 does not divide 2, so the pool's merged `[k h]` axis is whole on every chip
    (`paged.paged_cache_spec`) and each chip's kernel reads every kv head. Split by k h (64
    lanes per chip, mid-head) while q's kv-head axis stayed whole, Mosaic refused the kernel
    ("DMA source and target shape mismatch"). Its values against the XLA path:
    `test_paged_attention.py`, on the same mesh in interpret mode."""
    cfg = _config(precision="float32", mesh=(1, 1, 4), tensor_parallel=4, rollout_dtype="bfloat16")
    assert (cfg.model.n_kv_heads, cfg.rollout.tensor_parallel) == (2, 4)
    programs = _compile(cfg, "v5p:2x2x1", programs=("engine/decode_loop",))
    decode = _one(programs, "engine/decode_loop")
    assert "kernel" in decode.name and decode.mosaic_kernels == 1


def test_float32_at_long_sequences_compiles_with_blockwise_attention():
    """At T = 2,048 (1,024 prompt + 1,024 response tokens) `auto` gives the float32 update the
    blockwise path on TPU too: it compiles on a (1, 2, 2) mesh and the compiled program holds
    no T x T array (the explicit path's scores and probabilities are [.., 2048, 2048])."""
    cfg = _config(
        precision="float32",
        mesh=(1, 2, 2),
        tensor_parallel=2,
        rollout_dtype="bfloat16",
        prompt_len=1024,
        decode_len=1024,
        prompts=1,
    )
    specs, _ = train_specs(cfg, topology_devices("v5p:2x2x1"))
    update = specs[0]
    assert update.name == "rl_update"
    hlo = update.jitted.trace(*update.args).lower().compile().as_text()
    square = re.findall(r"\[[\d,]*2048,2048[\d,]*\]", hlo)
    assert "dot(" in hlo or "convolution(" in hlo
    assert square == [], square[:3]


def test_dot_flops_count_loops_by_their_trip_count():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((4, 8), jnp.float32)
    w = jnp.ones((8, 8), jnp.float32)

    def body(c, _):
        return c @ w, None

    one = compiled.dot_flops(jax.make_jaxpr(lambda x: x @ w)(x))
    assert one == 2 * 4 * 8 * 8
    scanned = jax.make_jaxpr(lambda x: jax.lax.scan(body, x, None, length=5)[0])(x)
    assert compiled.dot_flops(scanned) == 5 * one
    looped = jax.make_jaxpr(lambda x: jax.lax.while_loop(lambda c: c[0, 0] < 9, lambda c: c @ w, x))
    assert compiled.dot_flops(looped(x), while_trips=3) == 3 * one


def test_failures_name_the_program_and_the_reason():
    fits = compiled.Program("a", argument=2 * _GIB, temp=5 * _GIB)
    too_big = compiled.Program("rl_update", argument=2 * _GIB, temp=14 * _GIB, resident=_GIB)
    broken = compiled.Program("engine/prefill[1x128]", error="NotImplementedError: Mosaic kernels")
    lines = compiled.failures([fits, too_big, broken], hbm=16.0, fraction=0.9)
    assert lines == [
        "rl_update does not fit: peak 17.0 GiB per chip (resident 1.0) > 90% of 16.0 GiB",
        "engine/prefill[1x128] does not compile: NotImplementedError: Mosaic kernels",
    ]


def test_aot_command_on_the_tiny_config_on_two_hosts_with_every_axis_split():
    """The command (the one fresh interpreter of this file) on the embedded tiny config (char
    tokenizer, SFT warm-up, head_dim 32) on 8 devices of two hosts, mesh (2, 2, 2): the
    three-pass float32_x3 trainer with a tied embedding and 2 micro-batches; each host's engine
    on a tensor row of the trainer's mesh (bf16 compute, but h = 32: the explicit path), with
    int4 weights and an fp8 cache. Every program compiles, no Mosaic kernel, the table and one
    JSON line on stdout, exit 0; the update priced at two response-length mixes from the one
    compile (a long tail of mean 2 and every response at the cap)."""
    from configs import tiny_cpu

    cap = tiny_cpu.get_config().rollout.max_decode_length
    overrides = {
        "mesh.data": 2,
        "mesh.fsdp": 2,
        "mesh.tensor": 2,
        "train.precision": "float32_x3",
        "train.micro_batches": 2,
        "model.tie_embeddings": True,
        "rollout.tensor_parallel": 2,
        "rollout.dtype": "bfloat16_fp8kv_int4w",
    }
    out = subprocess.run(
        [sys.executable, "-m", "dvp_jax.aot", "--config=configs/tiny_cpu.py"]
        + ["--topology=v5p:2x2x2", f"--response_length_mean=2,{cap}", "--prompt_length=4"]
        + [f"--config.{name}={value}" for name, value in overrides.items()],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {p["program"]: p for p in result["programs"]}
    for name in ("rl_update", "sft_step", "engine/init_state"):
        assert name in rows, sorted(rows)
    assert "engine/insert_batch" in rows and "weight_sync/on_device" in rows
    assert any(n.startswith("engine/decode_loop") for n in rows)
    assert result["ok"] and all(p["error"] == "" for p in rows.values())
    assert all(p["mosaic_kernels"] == 0 for p in rows.values())
    update = rows["rl_update"]
    assert 0 < update["attention_tflop_per_call"] < update["tflop_per_call"]
    assert "rl_update" in out.stdout.splitlines()[2]  # the table's first row
    short, full = result["update_at_real_lengths"]
    assert (short["response_length_mean"], full["response_length_mean"]) == (2.0, cap)
    for mix in (short, full):
        padded, packed = mix["layouts"]
        assert (padded["layout"], packed["layout"]) == ("before packing", "packed")
        assert packed["tflop_per_chip"] <= padded["tflop_per_chip"]
        assert packed["rows"] <= padded["rows"]
    # Sequences of 4 + ~2 tokens pack several to a row: fewer rows than responses.
    assert short["layouts"][1]["rows"] < short["layouts"][0]["rows"]
    assert "packed / padded FLOPs" in out.stdout
    # The rollout at the same lengths, dense, paged kernel and paged XLA (at these few-token
    # lengths a 64-position page reads more than dense's smallest 32-position bucket), and the
    # whole step's bound.
    for mix in result["rollout_at_real_lengths"]:
        dense, kernel, xla = mix["decodes"]
        assert (dense["decode"], kernel["decode"], xla["decode"]) == (
            "dense",
            "paged kernel",
            "paged XLA",
        )
        assert min(dense["steps"], kernel["steps"], xla["steps"]) > 0
        assert kernel["kv_over_live"] >= 1 and xla["kv_gb"] >= kernel["kv_gb"]
    assert len(result["step_lower_bound"]) == 2
    assert "bytes/dense" in out.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        ({"topology": "v9:2x2"}, "--topology 'v9:2x2' is not <chip>:<dims>"),
        ({"config.mesh.tensor": 3}, "config.mesh"),
        ({"response_length_mean": ["4", "many"]}, "--response_length_mean: 'many' is not a"),
        ({"response_length_mean": ["99999"]}, "--response_length_mean=99999 is above rollout."),
        ({"prompt_length": 99, "response_length_mean": ["4"]}, "--prompt_length=99 must be in"),
        ({"response_lengths": "/no/such/file"}, "--response_lengths /no/such/file: No such file"),
    ],
)
def test_aot_command_refuses_bad_input_in_one_line(override, message, monkeypatch, capsys):
    """`aot.main` on the flags' values (in this process: no compile is reached): a bad
    topology, a mesh the topology cannot hold, or a bad response-length flag ends with exit
    status 2 and one line."""
    import types

    from configs import tiny_cpu

    config = tiny_cpu.get_config()
    values = {"topology": "v5p:2x2x1", "all_buckets": False, "programs": "", "json_out": ""}
    values.update(hbm_fraction=0.9, verbose=False, config=config)
    values.update(response_length_mean=[], response_lengths="", prompt_length=None)
    for name, value in override.items():
        if name.startswith("config."):
            config.mesh.tensor = value
        else:
            values[name] = value
    flags = {name: types.SimpleNamespace(value=value) for name, value in values.items()}
    monkeypatch.setattr(aot, "_FLAGS", flags)
    with pytest.raises(SystemExit) as exit_info:
        aot.main(["aot"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], lines[-3:]


def test_a_micro_batch_that_does_not_split_over_the_shards_is_named():
    """8 rows in 4 micro-batches on a (1, 4, 1) mesh: 2 rows per micro-batch cannot split over
    4 fsdp shards (the Sharder replicates them), which the update's row says; nothing is
    compiled to find it."""
    cfg = _config(
        precision="float32",
        mesh=(1, 4, 1),
        tensor_parallel=1,
        rollout_dtype="bfloat16",
        micro_batches=4,
    )
    specs, _ = train_specs(cfg, topology_devices("v5p:2x2x1"))
    assert "2 rows does not split over the 4 data x fsdp shards" in specs[0].warning
    even = _config(precision="float32", mesh=(1, 4, 1), tensor_parallel=1, rollout_dtype="bfloat16")
    assert train_specs(even, topology_devices("v5p:2x2x1"))[0][0].warning == ""


def test_weight_sync_through_the_host_when_the_engine_is_not_a_trainer_row():
    """A float32 engine at tensor parallel 2 beside a (1, 4, 1) trainer mesh is no row of it:
    its programs compile, and the sync casts where the trainer's params are and copies the
    whole float32 model to the host's engine (reported per host)."""
    cfg = _config(precision="float32", mesh=(1, 4, 1), tensor_parallel=2, rollout_dtype="float32")
    programs = aot.compile_config(
        cfg, "v5p:2x2x1", programs=("weight_sync", "engine/"), log=lambda _: None
    )
    assert [p.error for p in programs] == [""] * len(programs)
    names = [p.name for p in programs]
    assert "weight_sync/via_host" in names and "weight_sync/on_device" not in names
    assert any(name.startswith("engine/decode_loop") for name in names)
    from flax import nnx

    from dvp_jax.model import ROLLOUT_POLICY, Transformer
    from dvp_jax.sharding import count_params

    model = nnx.eval_shape(lambda: Transformer(cfg.model, ROLLOUT_POLICY, rngs=nnx.Rngs(0)))
    sync = programs[names.index("weight_sync/via_host")]
    assert sync.moved == 4 * count_params(nnx.state(model, nnx.Param))  # float32 bytes
