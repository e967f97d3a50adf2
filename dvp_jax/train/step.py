"""The DVP-RLOO update (E2, E5-E9): a pure function of (TrainState, RLBatch), jitted once.

`rl_update(state, batch) -> (state, metrics)` is jitted by `jit_step` with explicit in/out
shardings and the state donated. The trainer applies the unembedding itself in vocabulary chunks
(`token_stats` -> `chunked_token_stats`), so no `[tokens, vocab]` fp32 logits exist; the same
pass gives the policy entropy (`diagnostics.tail_metrics`).
`apply_gradients` is shared with the supervised warm-up (`train/sft.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dvp_jax.dvp import diagnostics
from dvp_jax.dvp.chunked import PositionStats, chunked_token_stats
from dvp_jax.dvp.losses import LossConfig, dvp_loss
from dvp_jax.dvp.pruning import TokenLogprobs
from dvp_jax.sharding import Sharder, compiler_options
from dvp_jax.train.batch import RLBatch
from dvp_jax.train.state import TrainState, skipped_updates


def token_logprobs(params, graphdef, tokens, positions, valid, **kwargs) -> TokenLogprobs:
    """Trainer-side pruned logprobs of tokens[:, 1:] given tokens[:, :-1] (E1-E3), [B, T-1]: the
    `TokenLogprobs` of `token_stats`, which takes the same (keyword) arguments."""
    return token_stats(params, graphdef, tokens, positions, valid, **kwargs)[0]


def token_stats(
    params,
    graphdef,
    tokens,
    positions,
    valid,
    *,
    log_rho: float,
    temperature: float,
    chunk_size: int,
    policy_entropy: bool = False,
) -> tuple[TokenLogprobs, PositionStats]:
    """`token_logprobs` and the per-position entropy / log_rel of the same pass, each [B, T-1]
    (with `policy_entropy`, also the differentiable H(pi_S) of the entropy bonus, E12)."""
    model = nnx.merge(graphdef, params)
    hidden = model(tokens, positions, valid, return_hidden=True)[:, :-1]  # [B, T-1, d]
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
    )
    return jax.tree.map(lambda x: x.reshape(b, t), out)


def _normaliser(metrics, loss_cfg: LossConfig):
    key = "kept_tokens" if loss_cfg.normalisation == "token_mean" else "kept_responses"
    return metrics[key]


def rl_update(
    state: TrainState,
    batch: RLBatch,
    *,
    graphdef,
    optimizer,
    loss_cfg: LossConfig,
    chunk_size: int,
    micro_batches: int,
):
    """One DVP-RLOO optimizer step, accumulating gradients over `micro_batches`.

    Gradient accumulation is exact for both normalisations: each micro-batch contributes its
    un-normalised sum (loss_m * Z_m, with Z_m its kept-token or kept-response count, which has
    no gradient), and the accumulated gradient is divided by the batch total Z. The KL and
    entropy terms (E11, E12) share E9's Z, so the same holds with them.
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

    def loss_of(tl: TokenLogprobs, stats: PositionStats, b: RLBatch):
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
        )

    def micro_sum(params, mb: RLBatch):
        tl, stats = stats_fn(params, tokens=mb.tokens, positions=mb.positions, valid=mb.valid)
        loss, metrics = loss_of(tl, stats, mb)
        z = jax.lax.stop_gradient(_normaliser(metrics, loss_cfg))
        return loss * z, (z, tl, stats)

    grad_fn = jax.grad(micro_sum, has_aux=True)
    split = jax.tree.map(
        lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch
    )

    def accumulate(grads, mb):
        g, aux = grad_fn(state.params, mb)
        return jax.tree.map(jnp.add, grads, g), aux

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (zs, tls, stats) = jax.lax.scan(accumulate, zeros, split)
    total_z = jnp.sum(zs)
    grads = jax.tree.map(lambda g: g / jnp.maximum(total_z, 1.0), grads)
    tl, stats = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), (tls, stats))  # [B, T-1]

    # Reported loss and loss metrics: the same objective on the whole batch (no model call).
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
    )
    new_state, step_metrics = apply_gradients(state, grads, optimizer)
    metrics |= step_metrics
    metrics["loss"] = loss
    return new_state, metrics


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
    )
    return jit_step(fn, state_shardings, batch_shardings, sharder)
