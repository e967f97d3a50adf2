"""The step at real lengths, printed and returned for the aot command's JSON line: the update's
cost (`update_cost`, from the compiled `rl_update`'s FLOPs), the rollout's (`rollout_cost`, the
engine's scheduler replayed, with bytes per chip from one host's abstract engine) and the whole
step's lower bound; each at the length mixes `length_mix.length_mixes` gives.
"""

from __future__ import annotations

from dvp_jax.plan import partial_cost, rollout_cost, update_cost
from dvp_jax.plan.compiled import Program, per_chip_bytes
from dvp_jax.plan.topology import (
    CHIP_BF16_FLOPS,
    CHIP_HBM_BYTES_PER_S,
    chip_of,
    topology_devices,
)


def update_cost_report(cfg, opts, results: list[Program], mixes) -> list[dict]:
    """Prints the update's cost at each step's real lengths (`update_cost.py`), all from the one
    compiled `rl_update`, and returns them for the JSON line; says so when `rl_update` was not
    compiled (`--programs`)."""
    update = next((p for p in results if p.name == "rl_update" and not p.error), None)
    if update is None:
        print("\n(rl_update was not compiled: no update cost at real lengths)", flush=True)
        return []
    chip = chip_of(opts["topology"])
    hosts = len({d.process_index for d in topology_devices(opts["topology"])})
    out = []
    for name, prompts, responses in mixes:
        print(
            f"\nupdate at real lengths: responses {name} (mean {responses.mean():,.0f}, max "
            f"{responses.max():,}), prompts {prompts.mean():,.0f} tokens",
            flush=True,
        )
        costs = update_cost.update_costs(
            cfg,
            prompts,
            responses,
            hosts=hosts,
            flops=update.flops,
            attention_flops=update.attention_flops,
            peak_flops=CHIP_BF16_FLOPS[chip],
        )
        print(update_cost.table(costs, cfg.train.precision, CHIP_BF16_FLOPS[chip]), flush=True)
        out.append(
            {
                "lengths": name,
                "response_length_mean": float(responses.mean()),
                "prompt_length_mean": float(prompts.mean()),
                "peak_bf16_tflops": CHIP_BF16_FLOPS[chip] / 1e12,
                "passes": update_cost.PASSES[cfg.train.precision],
                "layouts": [c.row() for c in costs],
            }
        )
    return out


def rollout_cost_report(cfg, opts, mixes) -> list[dict]:
    """Prints the rollout's cost at each step's real lengths, dense, paged kernel and paged
    XLA (`rollout_cost.py`, replaying the engine's scheduler), with bytes per chip from one
    host's abstract engine (its weights' and its cache's shardings), and returns them for the
    JSON line."""
    import jax

    from dvp_jax.model.paged import paged_cache_shape, paged_cache_sharding
    from dvp_jax.rollout.engine import RolloutEngine
    from dvp_jax.sharding import MeshConfig, make_mesh
    from dvp_jax.train.build import engine_config

    devices = topology_devices(opts["topology"])
    chip, hosts = chip_of(opts["topology"]), len({d.process_index for d in devices})
    tp = cfg.rollout.tensor_parallel
    mesh = make_mesh(MeshConfig(1, 1, tp), devices[:tp])
    engine = RolloutEngine(cfg.model, engine_config(cfg), "char", mesh=mesh, abstract=True)
    ec = engine.config
    shape = paged_cache_shape(cfg.model, ec.num_pages, ec.page_size)
    pool = jax.ShapeDtypeStruct(
        shape,
        engine.policy.cache_dtype,
        sharding=paged_cache_sharding(engine.sharder, shape, cfg.model.n_kv_heads),
    )
    kv_per_position = 2 * per_chip_bytes(pool) / (ec.num_pages * ec.page_size)  # k and v
    weights = per_chip_bytes(engine.params)
    bandwidth = CHIP_HBM_BYTES_PER_S[chip]
    out = []
    for name, prompts, responses in mixes:
        print(
            f"\nrollout at real lengths: responses {name} (mean {responses.mean():,.0f}, max "
            f"{responses.max():,}), {ec.max_concurrent_decodes} slots per host, weights "
            f"{weights / 1e9:.2f} GB and KV {kv_per_position / 1024:.0f} KiB per position per chip",
            flush=True,
        )
        costs = rollout_cost.rollout_costs(
            prompts,
            responses,
            hosts=hosts,
            config=ec,
            weight_bytes=weights,
            kv_bytes_per_position=kv_per_position,
            hbm_bytes_per_s=bandwidth,
        )
        print(rollout_cost.table(costs, bandwidth), flush=True)
        partial = partial_report(cfg, opts, engine, prompts, responses, weights, kv_per_position)
        out.append(
            {
                "lengths": name,
                "response_length_mean": float(responses.mean()),
                "hbm_tb_per_s": bandwidth / 1e12,
                "decodes": [c.row() for c in costs],
                "partial": [c.row() for c in partial],
            }
        )
    return out


def partial_report(cfg, opts, engine, prompts, responses, weights, kv_per_position):
    """Prints and returns the rollout synchronous vs partial at each `--oversample`
    (`partial_cost.py`: one host, the paged kernel's bytes)."""
    from dvp_jax.rollout.scheduler import Limits

    chip = chip_of(opts["topology"])
    hosts = len({d.process_index for d in topology_devices(opts["topology"])})
    oversamples = tuple(float(x) for x in opts.get("oversample") or (1.25, 1.5, 2, 3))
    costs = partial_cost.partial_costs(
        Limits.of(engine.config, "kernel"),
        groups_per_step=max(cfg.train.prompts_per_step // hosts, 1),
        group_size=cfg.train.group_size,
        prompt_length=int(prompts.max()),
        lengths=responses,
        oversamples=oversamples,
        max_staleness=cfg.rollout.max_staleness,
        weight_bytes=weights,
        kv_bytes_per_position=kv_per_position,
        hbm_bytes_per_s=CHIP_HBM_BYTES_PER_S[chip],
    )
    print(
        f"\nrollout with partial rollouts (rollout.partial; max_staleness "
        f"{cfg.rollout.max_staleness}), {max(cfg.train.prompts_per_step // hosts, 1)} groups of "
        f"{cfg.train.group_size} per host per step:",
        flush=True,
    )
    print(partial_cost.table(costs), flush=True)
    return costs


def step_lower_bound(update: list[dict], rollout: list[dict]) -> list[dict]:
    """Prints and returns the whole step's lower bound at each length mix: the padded update
    with the dense rollout, and the packed update with each paged rollout (the kernel on TPU,
    the ragged XLA path elsewhere)."""
    out = []
    if not update or not rollout:
        return out
    print("\nwhole step (update at peak FLOPs + rollout at HBM bandwidth; a lower bound):")
    for u, r in zip(update, rollout, strict=True):
        padded, packed = (c["seconds_at_peak"] for c in u["layouts"])
        dense, kernel, xla = (c["seconds"] for c in r["decodes"])
        row = {
            "lengths": u["lengths"],
            "padded_dense_s": padded + dense,
            "packed_kernel_s": packed + kernel,
            "packed_xla_s": packed + xla,
        }
        for c in r.get("partial", [])[1:]:  # the kernel's rollout with partial rollouts
            row[f"packed_kernel_{c['mode'].replace(' ', '_')}_s"] = packed + c["seconds"]
        print(
            f"  {row['lengths']:<26} padded + dense {row['padded_dense_s']:>8,.0f} s, packed + "
            f"paged kernel {row['packed_kernel_s']:>8,.0f} s, packed + paged XLA "
            f"{row['packed_xla_s']:>8,.0f} s"
            + "".join(
                f", {c['mode']} {packed + c['seconds']:,.0f} s" for c in r.get("partial", [])[1:]
            )
        )
        out.append(row)
    return out
