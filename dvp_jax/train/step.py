"""The DVP-RLOO update (E2, E5-E9): a pure function of (TrainState, RLBatch), jitted once.

`rl_update(state, batch) -> (state, metrics)` is jitted by `jit_step` with explicit in/out
shardings and the state donated. The batch is the packer's rows (`train/packing.py`: several
sequences per row, told apart by segment ids) or one response per row; it is cut into
micro-batches, and a micro-batch without a response token is skipped (`lax.cond`), so one
compiled program serves every mix of lengths and only the rows that hold tokens cost a forward
and a backward. The trainer applies the unembedding itself in vocabulary chunks (`token_stats`
-> `chunked_token_stats`), so no `[tokens, vocab]` fp32 logits exist; the same pass gives the
policy entropy (`diagnostics.tail_metrics`). `batch_logprobs` is the forward alone (the
decoupled PPO's old policy, the KL reference). `apply_gradients` is shared with the supervised
warm-up (`train/sft.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dvp_jax.dvp import batch_stats, diagnostics, staleness
from dvp_jax.dvp.chunked import PositionStats, chunked_token_stats
from dvp_jax.dvp.losses import LossConfig, dvp_loss, weight_total
from dvp_jax.dvp.pruning import TokenLogprobs
from dvp_jax.dvp.segments import Segments
from dvp_jax.sharding import Sharder, compiler_options
from dvp_jax.train.batch import RLBatch
from dvp_jax.train.packing import micro_batch_join, micro_batch_split
from dvp_jax.train.state import TrainState, skipped_updates


def token_logprobs(params, graphdef, tokens, positions, segment_ids, **kwargs) -> TokenLogprobs:
    """Trainer-side pruned logprobs of tokens[:, 1:] given tokens[:, :-1] (E1-E3), [B, T-1]: the
    `TokenLogprobs` of `token_stats`, which takes the same (keyword) arguments."""
    return token_stats(params, graphdef, tokens, positions, segment_ids, **kwargs)[0]


def token_stats(
    params,
    graphdef,
    tokens,
    positions,
    segment_ids,
    *,
    log_rho: float,
    temperature: float,
    chunk_size: int,
    policy_entropy: bool = False,
    kept_ids=None,
) -> tuple[TokenLogprobs, PositionStats]:
    """`token_logprobs` and the per-position entropy / log_rel of the same pass, each [B, T-1]
    (with `policy_entropy`, also the differentiable H(pi_S) of the entropy bonus, E12).
    `segment_ids`: the model's (int32 packed segments, or bool valid). `kept_ids` [B, T-1, W]:
    the rollout's truncation sets (E13, `RLBatch.behaviour_kept_ids`); None: no truncation."""
    model = nnx.merge(graphdef, params)
    hidden = model(tokens, positions, segment_ids, return_hidden=True)[:, :-1]  # [B, T-1, d]
    b, t, d = hidden.shape
    out = chunked_token_stats(
        hidden.reshape(b * t, d),
        # In the compute dtype (bf16 under mixed_bf16): a bf16 x fp32 product would be promoted
        # to an fp32 matmul. Logits still accumulate in float32.
        model.unembedding().astype(model.policy.compute_dtype),
        tokens[:, 1:].reshape(b * t),
        log_rho=log_rho,
        temperature=temperature,
        chunk_size=chunk_size,
        # On a mesh the vocabulary loop runs per tensor shard of W (no all-gather of W).
        mesh=model.sharder.mesh,
        precision=model.policy.precision,  # `highest` for the fp32 trainer (TRAIN_POLICY)
        policy_entropy=policy_entropy,
        kept_ids=None if kept_ids is None else kept_ids.reshape(b * t, kept_ids.shape[-1]),
    )
    return jax.tree.map(lambda x: x.reshape(b, t), out)


def _normaliser(metrics, loss_cfg: LossConfig):
    key = "kept_tokens" if loss_cfg.normalisation == "token_mean" else "kept_responses"
    return metrics[key]


def _segments(b: RLBatch, sequences_per_row: int | None) -> Segments | None:
    """Which response each target of `b` belongs to: packed rows (`sequences_per_row` the most a
    row holds) by segment id, else one response per row (None)."""
    if sequences_per_row is None:
        return None
    return Segments(b.segment_ids[:, 1:], sequences_per_row)


def _model_segments(b: RLBatch, sequences_per_row: int | None):
    """The model's segment input: the ids of packed rows, else bool valid (one per row)."""
    return b.segment_ids if sequences_per_row is not None else b.segment_ids > 0


def _over_micro_batches(fn, batch, response_mask, micro_batches: int, carry):
    """`fn(carry, mb) -> (carry, out)` over the micro-batches of `batch` (any pytree of `[rows,
    ...]` arrays, `micro_batch_split`), skipping (carry unchanged, out zeros) those whose rows
    of `response_mask` hold no response token: they add nothing to a gradient, a loss or a
    metric, and cost nothing. Returns (carry, outs): per-row outs joined back to `[rows, ...]`,
    one value per micro-batch stacked `[M]`."""
    split, active = jax.tree.map(
        lambda x: micro_batch_split(x, micro_batches), (batch, response_mask)
    )
    first = jax.tree.map(lambda x: x[0], split)
    out_shape = jax.eval_shape(lambda c, mb: fn(c, mb)[1], carry, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

    def body(carry, xs):
        mb, mask = xs
        return jax.lax.cond(jnp.any(mask), fn, lambda c, _: (c, zeros), carry, mb)

    carry, outs = jax.lax.scan(body, carry, (split, active))
    return carry, jax.tree.map(lambda x: micro_batch_join(x) if x.ndim > 1 else x, outs)


def rl_update(
    state: TrainState,
    batch: RLBatch,
    *,
    graphdef,
    optimizer,
    loss_cfg: LossConfig,
    chunk_size: int,
    micro_batches: int,
    sequences_per_row: int | None = None,
):
    """One DVP-RLOO optimizer step, accumulating gradients over `micro_batches`.

    Gradient accumulation is exact for both normalisations: each micro-batch contributes its
    un-normalised sum (loss_m * Z_m, with Z_m its kept-token or kept-response count, which has
    no gradient), and the accumulated gradient is divided by the batch total Z. The KL and
    entropy terms (E11, E12) share E9's Z, so the same holds with them. Every sequence lies in
    one micro-batch, so its per-response terms (E5, the seq corrections) are whole there.

    Args:
      sequences_per_row: packed rows (`RLBatch.segment_ids` tell their sequences apart; at most
        this many per row, `packing.Layout.sequences_per_row`), or None: one response per row.
    """
    ppo = loss_cfg.ppo_clip_eps is not None
    with_h = loss_cfg.entropy_coef > 0
    stats_fn = functools.partial(
        token_stats,
        graphdef=graphdef,
        log_rho=loss_cfg.effective_log_rho,
        temperature=loss_cfg.temperature,
        chunk_size=chunk_size,
        policy_entropy=with_h,
    )

    def loss_of(tl: TokenLogprobs, stats: PositionStats, b: RLBatch, norm=None):
        return dvp_loss(
            tl.logp,
            b.behaviour_logp,
            b.advantages,
            b.response_mask,
            tl.in_safe,
            loss_cfg,
            b.old_logp if ppo else None,
            b.old_in_safe if ppo else None,
            ref_logp=b.ref_logp if loss_cfg.uses_reference else None,
            ref_in_safe=b.ref_in_safe if loss_cfg.uses_reference else None,
            entropy=stats.policy_entropy if with_h else None,
            segments=_segments(b, sequences_per_row),
            is_weight_norm=norm,
        )

    # E17: a micro-batch weighs with its raw weights (norm 1) and returns their sum and count;
    # the batch mean divides the summed gradient (exact: the loss is then the policy term only).
    raw = 1.0 if loss_cfg.batch_normalise_weights else None

    def micro_sum(params, mb: RLBatch):
        segment_ids = _model_segments(mb, sequences_per_row)
        tl, stats = stats_fn(
            params,
            tokens=mb.tokens,
            positions=mb.positions,
            segment_ids=segment_ids,
            kept_ids=mb.behaviour_kept_ids,  # E13: the support the rollout sampled from
        )
        loss, metrics = loss_of(tl, stats, mb, raw)
        z = jax.lax.stop_gradient(_normaliser(metrics, loss_cfg))
        return loss * z, (z, weight_total(metrics, loss_cfg), tl, stats)

    grad_fn = jax.grad(micro_sum, has_aux=True)

    def accumulate(grads, mb):
        g, aux = grad_fn(state.params, mb)
        return jax.tree.map(jnp.add, grads, g), aux

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (zs, (w_sums, w_counts), tl, stats) = _over_micro_batches(
        accumulate, batch, batch.response_mask, micro_batches, zeros
    )
    total_z = jnp.maximum(jnp.sum(zs), 1.0)
    if loss_cfg.batch_normalise_weights:
        w_bar = jnp.sum(w_sums) / jnp.maximum(jnp.sum(w_counts), 1.0)
        total_z = total_z * jnp.where(w_bar > 0, w_bar, 1.0)
    grads = jax.tree.map(lambda g: g / total_z, grads)

    # Reported loss and loss metrics: the same objective on the whole batch (no model call).
    segments = _segments(batch, sequences_per_row)
    loss, metrics = loss_of(tl, stats, batch)
    metrics |= diagnostics.mismatch_diagnostics(
        logp=tl.logp,
        behaviour_logp=batch.behaviour_logp,
        response_mask=batch.response_mask,
        in_safe=tl.in_safe if loss_cfg.pruning else None,
        logp_full=tl.logp_full,
        behaviour_logp_full=batch.behaviour_logp_full,
        pruned_mass=tl.pruned_mass,
        safe_size=tl.safe_size,
        behaviour_pruned_mass=batch.behaviour_pruned_mass,
        behaviour_safe_size=batch.behaviour_safe_size,
        segments=segments,
    )
    # The trainer's safe set at the configured rho, also when the objective does not prune
    # (then the pass ran with log_rho = -inf and membership comes from z_y - max z >= log rho).
    safe = tl.in_safe if loss_cfg.pruning else stats.log_rel >= loss_cfg.log_rho
    metrics |= diagnostics.tail_metrics(
        logp=tl.logp,
        behaviour_logp=batch.behaviour_logp,
        logp_full=tl.logp_full,
        behaviour_logp_full=batch.behaviour_logp_full,
        response_mask=batch.response_mask,
        safe=safe,
        in_safe=tl.in_safe if loss_cfg.pruning else None,
        entropy=stats.entropy,
        segments=segments,
    )
    if batch.behaviour_age is not None:  # partial rollouts: the mismatch split by staleness
        metrics |= staleness.staleness_metrics(
            tl.logp_full, batch.behaviour_logp_full, batch.response_mask, batch.behaviour_age
        )
    if batch.behaviour_truncated_mass is not None:  # E13: what top-k / top-p removed
        metrics |= batch_stats.truncation_metrics(
            batch.behaviour_truncated_mass, batch.behaviour_kept_ids, batch.response_mask
        )
    new_state, step_metrics = apply_gradients(state, grads, optimizer)
    metrics |= step_metrics
    metrics["loss"] = loss
    return new_state, metrics


def batch_logprobs(
    params,
    inputs: tuple,
    *,
    graphdef,
    log_rho: float,
    temperature: float,
    chunk_size: int,
    micro_batches: int,
    sequences_per_row: int | None = None,
) -> TokenLogprobs:
    """log pi_S of every target of a batch under `params` (E1-E3), `[B, T-1]`, by micro-batches
    as `rl_update` runs them (the forward alone): the decoupled PPO's old policy (E9) and the
    KL reference (E11), computed before the first update on a batch.

    Args:
      inputs: `logprob_inputs(batch)`: (tokens, positions, segment_ids, response_mask), and the
        kept ids when the rollout truncates (E13).
    """
    tokens, positions, segment_ids, response_mask, *kept = inputs

    def forward(carry, mb):
        tok, pos, seg, *kept_ids = mb
        seg = seg if sequences_per_row is not None else seg > 0
        out = token_logprobs(
            params,
            graphdef,
            tok,
            pos,
            seg,
            log_rho=log_rho,
            temperature=temperature,
            chunk_size=chunk_size,
            kept_ids=kept_ids[0] if kept_ids else None,
        )
        return carry, out

    mbs = (tokens, positions, segment_ids, *kept)
    return _over_micro_batches(forward, mbs, response_mask, micro_batches, ())[1]


def logprob_inputs(batch: RLBatch) -> tuple:
    """What `batch_logprobs` reads of a batch (the kept ids only when it has them, E13)."""
    kept = () if batch.behaviour_kept_ids is None else (batch.behaviour_kept_ids,)
    return batch.tokens, batch.positions, batch.segment_ids, batch.response_mask, *kept


def apply_gradients(state: TrainState, grads, optimizer):
    """One optax update; metrics grad_norm, update_norm and skipped_updates."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "skipped_updates": skipped_updates(opt_state).astype(jnp.float32),
    }
    # The frozen reference (E11), when kept, passes through unchanged.
    new = dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state)
    return new, metrics


def jit_step(fn, state_shardings, batch_sh, sharder: Sharder):
    """Jits a step with explicit in/out shardings, the train state donated, and the project's
    compiler options for the mesh's platform (`sharding.compiler_options`)."""
    options = compiler_options(sharder)
    if sharder.mesh is None:
        return jax.jit(fn, donate_argnums=0, compiler_options=options)
    return jax.jit(
        fn,
        in_shardings=(state_shardings, batch_sh),
        out_shardings=(state_shardings, sharder.replicated()),
        donate_argnums=0,
        compiler_options=options,
    )


def jit_rl_update(
    *,
    graphdef,
    optimizer,
    loss_cfg: LossConfig,
    chunk_size: int,
    micro_batches: int,
    sequences_per_row: int | None,
    state_shardings,
    batch_shardings,
    sharder: Sharder,
):
    """`rl_update` jitted as the trainer runs it (and `dvp_jax.aot` compiles it)."""
    fn = functools.partial(
        rl_update,
        graphdef=graphdef,
        optimizer=optimizer,
        loss_cfg=loss_cfg,
        chunk_size=chunk_size,
        micro_batches=micro_batches,
        sequences_per_row=sequences_per_row,
    )
    return jit_step(fn, state_shardings, batch_shardings, sharder)


def jit_batch_logprobs(
    *,
    graphdef,
    loss_cfg: LossConfig,
    chunk_size: int,
    micro_batches: int,
    sequences_per_row: int | None,
    param_shardings,
    batch_shardings,
    sharder: Sharder,
):
    """`batch_logprobs` jitted as the trainer runs it (and `dvp_jax.aot` compiles it):
    (params, `logprob_inputs(batch)`) -> `TokenLogprobs` of the batch's targets, laid out like
    the batch."""
    fn = functools.partial(
        batch_logprobs,
        graphdef=graphdef,
        log_rho=loss_cfg.effective_log_rho,
        temperature=loss_cfg.temperature,
        chunk_size=chunk_size,
        micro_batches=micro_batches,
        sequences_per_row=sequences_per_row,
    )
    options = compiler_options(sharder)
    if sharder.mesh is None:
        return jax.jit(fn, compiler_options=options)
    per_token = batch_shardings.response_mask
    out = TokenLogprobs(*(per_token for _ in TokenLogprobs._fields))
    return jax.jit(
        fn,
        in_shardings=(param_shardings, logprob_inputs(batch_shardings)),
        out_shardings=out,
        compiler_options=options,
    )
