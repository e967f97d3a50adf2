"""What one step's update costs at real lengths: the rows the packer needs, the FLOPs per chip,
and the time the chip's matmul units would need for them at peak (a lower bound).

`dvp_jax.aot` compiles the update for the config's rows (`programs.update_layout`) and counts
its dots with every loop at its trip count (`compiled.dot_flops`), attention apart. Those
counts are of the program, not of the data: every micro-batch is counted as run and every
block pair of the blockwise attention as visited. At real lengths the update skips
micro-batches without a response token and each row's blockwise attention visits only the block
pairs its sequences need (`blockwise.block_visits`). So the figure here is

  FLOPs = micro-batches run x (dense FLOPs of one micro-batch)
        + block pairs visited x (attention FLOPs of one block pair),

with both unit costs read off the compiled program (its dense dots per row token, its attention
dots per counted block pair) and the counts from packing the step's lengths as the trainer
packs them (each host its own prompts' responses, `packing.pack`). "before packing" is the
update as it ran before packing and block skipping: one response per row, every micro-batch run,
and every causal block pair of every row visited (the kernel skipped only the pairs above the
diagonal).

The time is FLOPs over the chip's bf16 peak divided by the matmul passes of the trainer's
precision (`PASSES`): a compute-bound lower bound that ignores memory traffic, collectives,
elementwise work and the kernels' own efficiency. A Mosaic attention kernel (splash, under
mixed_bf16 on TPU) reports no FLOPs: its attention is then missing from the figure, which says
so.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dvp_jax.model.attention import select_attention_impl
from dvp_jax.model.blockwise import block_size, block_visits
from dvp_jax.model.config import DTypePolicy
from dvp_jax.plan.tables import Column, render
from dvp_jax.train.packing import Layout, first_fit_decreasing, make_layout

# bf16 passes per matmul of each trainer precision on TPU (docs/model.md's precision table):
# float32's `highest` is 6 bf16 products, float32_x3 3, mixed_bf16's bf16 operands 1.
PASSES = {"float32": 6, "float32_x3": 3, "mixed_bf16": 1}


@dataclasses.dataclass(frozen=True)
class UpdateCost:
    """One step's update in one layout.

    Attributes:
      layout: "before packing" or "packed".
      rows: rows holding a sequence, all hosts and updates of the step.
      micro_batches: micro-batch calls that run, all updates of the step.
      tflop_per_chip: dot FLOPs per chip for the step (attention's included unless
        `attention_counted` is False), in TFLOP.
      attention_share: the attention's part of `tflop_per_chip`.
      seconds_at_peak: `tflop_per_chip` at the chip's bf16 peak over the precision's passes.
      attention_counted: False when the attention kernel reports no FLOPs (splash).
    """

    layout: str
    rows: int
    micro_batches: int
    tflop_per_chip: float
    attention_share: float
    seconds_at_peak: float
    attention_counted: bool = True

    def row(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in vars(self).items()}


@dataclasses.dataclass(frozen=True)
class _Units:
    """Unit costs read off the compiled update (per chip, FLOPs)."""

    dense_per_token: float  # dense dots per row token (rows x row length) of a micro-batch
    attention_per_pair: float  # attention dots per visited block pair (or token pair)
    block: int  # the blockwise block, or 1 for the explicit path (token pairs)
    attention_counted: bool


def _units(cfg, layout: Layout, hosts: int, flops: float, attention_flops: float) -> _Units:
    """Unit costs of the update compiled for `layout` (`flops`, `attention_flops`: the compiled
    program's per chip)."""
    t = cfg.train
    policy = DTypePolicy.named(t.precision, t.attention_impl, t.attention_block)
    impl = select_attention_impl(
        policy.attention_impl, "tpu", policy.compute_dtype, layout.row_length, cfg.model.head_dim
    )
    rows, length = layout.rows * hosts, layout.row_length
    dense = (flops - attention_flops) / (rows * length)
    if impl == "blockwise":
        block = block_size(length, policy.attention_block)
        nb = -(-length // block)
        return _Units(dense, attention_flops / (rows * nb * nb), block, True)
    if impl in ("xla", "dot_product"):  # the whole T x T, every row of a micro-batch that runs
        return _Units(dense, attention_flops / (rows * length * length), 1, True)
    return _Units(dense, 0.0, 1, False)  # a kernel without a FLOP count (splash, cudnn)


def _visited(segment_ids: np.ndarray, units: _Units, before: bool) -> float:
    """Block pairs the blockwise kernel computes for these rows (every causal one `before`
    packing)."""
    rows, length = segment_ids.shape
    nb = -(-length // units.block)
    if before:
        return float(rows * nb * (nb + 1) // 2)
    padded = np.zeros((rows, nb * units.block), np.int32)
    padded[:, :length] = segment_ids
    return float(block_visits(padded, units.block, np).sum())


def _host_rows(lengths: np.ndarray, layout: Layout) -> np.ndarray:
    """The segment ids `[filled rows, row length]` of one host's update packed by `layout`."""
    bins = (
        first_fit_decreasing(lengths, layout.row_length)
        if layout.packed
        else [[i] for i in range(len(lengths))]
    )
    out = np.zeros((len(bins), layout.row_length), np.int32)
    for row, members in enumerate(bins):
        start = 0
        for segment, i in enumerate(members, 1):
            out[row, start : start + lengths[i]] = segment
            start += lengths[i]
    return out


def update_costs(
    cfg,
    prompt_lengths: np.ndarray,
    response_lengths: np.ndarray,
    *,
    hosts: int,
    flops: float,
    attention_flops: float,
    peak_flops: float,
) -> list[UpdateCost]:
    """The step's update before packing and packed (module docstring).

    Args:
      cfg: the run's `ExperimentConfig`.
      prompt_lengths, response_lengths: `[prompts_per_step * group_size]` lengths, prompt-major
        (the G responses of prompt p at p * G ... p * G + G - 1), as a step's rollouts.
      hosts: hosts of the slice (each packs its share of the prompts).
      flops, attention_flops: the compiled update's dot FLOPs per chip, and their attention part
        (`compiled.Program`), for the config's layout (`programs.update_layout`).
      peak_flops: the chip's bf16 peak (FLOP/s).
    """
    from dvp_jax.train.programs import update_layout

    t = cfg.train
    layout = update_layout(cfg, hosts)
    units = _units(cfg, layout, hosts, flops, attention_flops)
    seconds_per_flop = PASSES[t.precision] / peak_flops
    lengths = np.asarray(prompt_lengths) + np.asarray(response_lengths)
    per_host = len(lengths) // hosts
    padded = make_layout(
        sequences=-(-per_host // t.updates_per_batch),
        longest=cfg.sequence_length,
        row_length=cfg.sequence_length,
        micro_batches=layout.micro_batches,
        packed=False,
    )
    out = []
    for name, use, before in (("before packing", padded, True), ("packed", layout, False)):
        rows = runs = 0
        pairs = 0.0
        per_micro = use.rows // use.micro_batches  # rows of one micro-batch on one host
        for part in range(t.updates_per_batch):
            active = 0
            for h in range(hosts):
                mine = lengths[h * per_host : (h + 1) * per_host]
                segments = _host_rows(np.array_split(mine, t.updates_per_batch)[part], use)
                rows += len(segments)
                active = max(active, -(-len(segments) // per_micro))
                if units.block > 1:
                    pairs += _visited(segments, units, before)
            if before:  # the update before packing ran every micro-batch
                active = use.micro_batches
            runs += active
        tokens = runs * per_micro * hosts * use.row_length  # every row of every run micro-batch
        if units.block == 1:  # the explicit path: each such row's whole T x T
            pairs = runs * per_micro * hosts * float(use.row_length) ** 2
        attention = pairs * units.attention_per_pair
        total = tokens * units.dense_per_token + attention
        out.append(
            UpdateCost(
                layout=name,
                rows=rows,
                micro_batches=runs,
                tflop_per_chip=total / 1e12,
                attention_share=attention / max(total, 1.0),
                seconds_at_peak=total * seconds_per_flop,
                attention_counted=units.attention_counted,
            )
        )
    return out


_COLUMNS = (
    Column("update", 16, left=True),
    Column("rows", 6),
    Column("micro-b.", 9),
    Column("TFLOP/chip", 11, ",.0f"),
    Column("attn", 5, ".0%"),
    Column("at peak", 9, ",.1f", "s"),
)


def table(costs: list[UpdateCost], precision: str, peak_flops: float) -> str:
    """The costs as lines of text, the packed one's ratio to the padded one's."""
    rows = [
        [c.layout, c.rows, c.micro_batches, c.tflop_per_chip, c.attention_share, c.seconds_at_peak]
        for c in costs
    ]
    notes = []
    if len(costs) == 2 and costs[0].tflop_per_chip:
        notes.append(
            f"packed / padded FLOPs: {costs[1].tflop_per_chip / costs[0].tflop_per_chip:.3f}"
        )
    note = (
        f"(per step; time = FLOPs at {peak_flops / 1e12:.0f} TFLOP/s bf16 / {PASSES[precision]} "
        f"passes ({precision}): a compute-bound lower bound"
    )
    if not costs[0].attention_counted:
        note += "; attention NOT counted: its kernel reports no FLOPs"
    notes.append(note + ")")
    return render(_COLUMNS, rows, notes)
