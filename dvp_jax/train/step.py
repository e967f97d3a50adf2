"""The jitted train steps: DVP-RLOO (E2, E5-E9) and the supervised warm-up.

Both steps are pure functions of (TrainState, batch) -> (TrainState, metrics), jitted once with
explicit in/out shardings and the state donated. The trainer applies the unembedding itself in
vocabulary chunks (`chunked_pruned_logprobs`), so no `[tokens, vocab]` fp32 logits exist.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dvp_jax.dvp import diagnostics
from dvp_jax.dvp.losses import LossConfig, dvp_loss
from dvp_jax.dvp.pruning import TokenLogprobs, chunked_pruned_logprobs
from dvp_jax.sharding import Sharder
from dvp_jax.train.state import TrainState, skipped_updates


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RLBatch:
    """One optimizer step's responses. T = prompt + response length; targets are tokens[:, 1:].

    Attributes:
      tokens, positions: [B, T] int32; valid: [B, T] bool (prompt and response tokens).
      response_mask: [B, T-1] bool, True where target tokens[:, t+1] is a response token.
      logp_rollout: [B, T-1] log mu_S of the target (E4); logp_full_rollout: unpruned log mu.
      pruned_mass_rollout, safe_size_rollout: [B, T-1] rollout-side E3 / |V_S|.
      advantages: [B] (E8).
      logp_old: [B, T-1] log pi_S_old for the decoupled PPO clip (zeros when unused).
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    response_mask: jax.Array
    logp_rollout: jax.Array
    logp_full_rollout: jax.Array
    pruned_mass_rollout: jax.Array
    safe_size_rollout: jax.Array
    advantages: jax.Array
    logp_old: jax.Array


def synthetic_batch(
    vocab_size: int, rows: int, length: int, prompt_len: int, seed: int = 0
) -> RLBatch:
    """A random host RLBatch (numpy) of fixed shapes, for benchmarks and tests.

    Every row has `prompt_len` prompt tokens then response tokens to the end; behaviour
    logprobs are uniform in [-4, -0.5] on response positions; advantages are standard normal.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, (rows, length)).astype(np.int32)
    response = np.zeros((rows, length - 1), bool)
    response[:, prompt_len - 1 :] = True
    logp = np.where(response, -rng.uniform(0.5, 4.0, (rows, length - 1)), 0).astype(np.float32)
    return RLBatch(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
        valid=np.ones((rows, length), bool),
        response_mask=response,
        logp_rollout=logp,
        logp_full_rollout=logp.copy(),
        pruned_mass_rollout=np.zeros_like(logp),
        safe_size_rollout=np.full_like(logp, float(vocab_size)),
        advantages=rng.normal(size=rows).astype(np.float32),
        logp_old=np.zeros_like(logp),
    )


def token_logprobs(
    params,
    graphdef,
    tokens,
    positions,
    valid,
    *,
    log_rho: float,
    temperature: float,
    chunk_size: int,
) -> TokenLogprobs:
    """Trainer-side pruned logprobs of tokens[:, 1:] given tokens[:, :-1] (E1-E3), [B, T-1]."""
    model = nnx.merge(graphdef, params)
    hidden = model(tokens, positions, valid, return_hidden=True)[:, :-1]  # [B, T-1, d]
    b, t, d = hidden.shape
    out = chunked_pruned_logprobs(
        hidden.reshape(b * t, d),
        model.unembedding(),
        tokens[:, 1:].reshape(b * t),
        log_rho=log_rho,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return jax.tree.map(lambda x: x.reshape(b, t), out)


def _normaliser(metrics, loss_cfg: LossConfig):
    key = "kept_tokens" if loss_cfg.normalisation == "token_mean" else "kept_responses"
    return metrics[key]


def rl_step(
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
    no gradient), and the accumulated gradient is divided by the batch total Z.
    """
    ppo = loss_cfg.ppo_clip_eps is not None
    logprob_fn = functools.partial(
        token_logprobs,
        graphdef=graphdef,
        log_rho=loss_cfg.effective_log_rho,
        temperature=loss_cfg.temperature,
        chunk_size=chunk_size,
    )

    def micro_sum(params, mb: RLBatch):
        tl = logprob_fn(params, tokens=mb.tokens, positions=mb.positions, valid=mb.valid)
        loss, metrics = dvp_loss(
            tl.logp,
            mb.logp_rollout,
            mb.advantages,
            mb.response_mask,
            tl.in_safe,
            loss_cfg,
            mb.logp_old if ppo else None,
        )
        z = jax.lax.stop_gradient(_normaliser(metrics, loss_cfg))
        return loss * z, (z, tl)

    grad_fn = jax.grad(micro_sum, has_aux=True)
    split = jax.tree.map(
        lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch
    )

    def accumulate(grads, mb):
        g, (z, tl) = grad_fn(state.params, mb)
        return jax.tree.map(jnp.add, grads, g), (z, tl)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (zs, tls) = jax.lax.scan(accumulate, zeros, split)
    total_z = jnp.sum(zs)
    grads = jax.tree.map(lambda g: g / jnp.maximum(total_z, 1.0), grads)
    tl = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tls)  # [B, T-1]

    # Reported loss and loss metrics: the same objective on the whole batch (no model call).
    loss, metrics = dvp_loss(
        tl.logp,
        batch.logp_rollout,
        batch.advantages,
        batch.response_mask,
        tl.in_safe,
        loss_cfg,
        batch.logp_old if ppo else None,
    )
    metrics |= diagnostics.mismatch_diagnostics(
        logp_train=tl.logp,
        logp_rollout=batch.logp_rollout,
        response_mask=batch.response_mask,
        in_safe_train=tl.in_safe if loss_cfg.pruning else None,
        logp_full_train=tl.logp_full,
        logp_full_rollout=batch.logp_full_rollout,
        pruned_mass_train=tl.pruned_mass,
        safe_size_train=tl.safe_size,
        pruned_mass_rollout=batch.pruned_mass_rollout,
        safe_size_rollout=batch.safe_size_rollout,
    )
    new_state, step_metrics = _apply(state, grads, optimizer)
    metrics |= step_metrics
    metrics["loss"] = loss
    return new_state, metrics


def _apply(state: TrainState, grads, optimizer):
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "skipped_updates": skipped_updates(opt_state).astype(jnp.float32),
    }
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng)
    return new, metrics


def sft_step(state: TrainState, batch, *, graphdef, optimizer, chunk_size: int):
    """Supervised warm-up: mean negative log-likelihood of the masked (answer) tokens.

    Args:
      batch: (tokens [B, T] int32 right-padded, loss_mask [B, T] 1.0 on tokens to predict,
        lengths [B] int32 real lengths).
    """
    tokens, loss_mask, lengths = batch
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = positions < lengths[:, None]
    mask = loss_mask[:, 1:].astype(jnp.float32)

    def loss_fn(params):
        tl = token_logprobs(
            params,
            graphdef,
            tokens,
            positions,
            valid,
            log_rho=None,
            temperature=1.0,
            chunk_size=chunk_size,
        )
        return -jnp.sum(tl.logp_full * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    new_state, metrics = _apply(state, grads, optimizer)
    metrics["sft_loss"] = loss
    return new_state, metrics


def batch_shardings(batch: RLBatch, sharder: Sharder):
    """Batch arrays shard their leading (batch) dim over the data axes."""
    if sharder.mesh is None:
        return None
    return jax.tree.map(
        lambda x: sharder.sharding(("act_batch",) + (None,) * (x.ndim - 1), x.shape), batch
    )


def jit_step(fn, state_shardings, batch_sh, sharder: Sharder):
    """Jits a step with explicit in/out shardings and the train state donated."""
    if sharder.mesh is None:
        return jax.jit(fn, donate_argnums=0)
    return jax.jit(
        fn,
        in_shardings=(state_shardings, batch_sh),
        out_shardings=(state_shardings, sharder.replicated()),
        donate_argnums=0,
    )
