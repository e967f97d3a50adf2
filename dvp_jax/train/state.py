"""Train state (fp32 master params, optax AdamW state, step, RNG, and the frozen KL reference
when the loss has one) and the optimizer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dvp_jax.sharding import Sharder, state_shardings

# Consecutive non-finite updates tolerated before optax applies one anyway; effectively "always
# skip": a run that produces non-finite gradients this often should be stopped by a human.
MAX_CONSECUTIVE_NONFINITE = 1_000_000


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything a resumed run needs on device.

    Attributes:
      step: [] int32, optimizer steps taken (RL steps; the SFT warm-up has its own counter).
      params: pure dict of fp32 parameters (`nnx.to_pure_dict` of the model state).
      opt_state: optax state, wrapped by `optax.apply_if_finite` (counts skipped updates).
      rng: [2] uint32 raw PRNG key; per-step keys are `fold_in(rng, step)`.
      ref_params: the frozen reference policy of the KL term (E11): a copy of `params` at the
        start of RL in `LossConfig.kl_reference_dtype`, sharded like them and checkpointed with
        them; None (nothing stored) when the loss has no KL term.
    """

    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array
    ref_params: dict | None = None


def make_optimizer(
    learning_rate: float,
    warmup_steps: int,
    weight_decay: float,
    grad_clip: float,
    b1: float = 0.9,
    b2: float = 0.999,
) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a linear warm-up to a constant rate.

    Wrapped in `optax.apply_if_finite`: a non-finite gradient leaves params and moments
    unchanged and increments `notfinite_count` / `total_notfinite` (logged as `skipped_updates`).
    """
    if warmup_steps > 0:
        schedule = optax.join_schedules(
            [
                optax.linear_schedule(0.0, learning_rate, warmup_steps),
                optax.constant_schedule(learning_rate),
            ],
            [warmup_steps],
        )
    else:
        schedule = optax.constant_schedule(learning_rate)
    inner = optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay),
    )
    return optax.apply_if_finite(inner, MAX_CONSECUTIVE_NONFINITE)


def skipped_updates(opt_state) -> jax.Array:
    """Total number of updates skipped for non-finite gradients."""
    return opt_state.total_notfinite


def reference_copy(params, dtype):
    """A copy of `params` in `dtype` (new buffers even when the dtype is unchanged, so donating
    the params never donates the reference); None when `dtype` is None."""
    if dtype is None:
        return None
    return jax.tree.map(lambda p: jnp.array(p, dtype=dtype, copy=True), params)


def _state_maker(optimizer: optax.GradientTransformation, seed: int, reference_dtype=None):
    def make(params):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            rng=jax.random.key_data(jax.random.key(seed)),
            ref_params=reference_copy(params, reference_dtype),
        )

    return make


def _train_state_shardings(abstract: TrainState, param_sh, optimizer, sharder: Sharder):
    replicated = sharder.replicated()
    return TrainState(
        step=replicated,
        params=param_sh,
        # Optimizer moments shard like the parameters they track; counters replicate.
        opt_state=optax.tree_map_params(
            optimizer,
            lambda _, sh: sh,
            abstract.opt_state,
            param_sh,
            transform_non_params=lambda _: replicated,
        ),
        rng=replicated,
        ref_params=None if abstract.ref_params is None else param_sh,
    )


def init_train_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    seed: int,
    sharder: Sharder,
    reference_dtype=None,
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Builds the train state from a (sharded) model; with `reference_dtype` (the KL term, E11)
    it also holds the model's params in that dtype as the frozen reference.

    Returns:
      (graphdef, state, state_shardings): the optimizer state is created under jit with
      out_shardings derived from the parameters' logical axes (moments shard like params).
    """
    graphdef, model_state = nnx.split(model)
    params = nnx.to_pure_dict(model_state)
    make = _state_maker(optimizer, seed, reference_dtype)
    if sharder.mesh is None:
        state = jax.jit(make)(params)
        return graphdef, state, None
    param_sh = nnx.to_pure_dict(state_shardings(model_state, sharder))
    shardings = _train_state_shardings(jax.eval_shape(make, params), param_sh, optimizer, sharder)
    state = jax.jit(make, out_shardings=shardings)(params)
    return graphdef, state, shardings


def with_fresh_optimizer(
    state: TrainState, params, optimizer: optax.GradientTransformation, shardings
) -> TrainState:
    """`state` with `params` and a newly initialised `optimizer` state (the step and key kept):
    how RL starts after the supervised warm-up, which had its own optimizer. A KL reference
    becomes a copy of `params` (in its dtype): the reference is the policy RL starts from."""

    def fresh(p, s):
        dtype = None if s.ref_params is None else jax.tree.leaves(s.ref_params)[0].dtype
        return TrainState(
            step=s.step,
            params=p,
            opt_state=optimizer.init(p),
            rng=s.rng,
            ref_params=reference_copy(p, dtype),
        )

    return jax.jit(fresh, out_shardings=shardings)(params, state)


def abstract_train_state(
    abstract_model: nnx.Module,
    optimizer: optax.GradientTransformation,
    sharder: Sharder,
    reference_dtype=None,
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """`init_train_state` of a model made by `nnx.eval_shape`, without allocating anything.

    Returns:
      (graphdef, state, state_shardings) where `state` holds `jax.ShapeDtypeStruct`s carrying
      the shardings `init_train_state` would give (what ahead-of-time lowering takes).
    """
    graphdef, model_state = nnx.split(abstract_model)
    params = nnx.to_pure_dict(model_state)
    abstract = jax.eval_shape(_state_maker(optimizer, 0, reference_dtype), params)
    param_sh = nnx.to_pure_dict(state_shardings(model_state, sharder))
    shardings = _train_state_shardings(abstract, param_sh, optimizer, sharder)
    state = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract, shardings
    )
    return graphdef, state, shardings
