"""The engine's own mismatch: the same requests decoded under different conditions.

No TPU engine decodes batch-invariantly, so a request's tokens and behaviour log-probs may
depend on what else the engine does while decoding it: how many slots are busy and which slot
it sits in (the attention's span bucket and the prefill's row count follow from that), the page
layout (a short pool gives other page ids and evicts responses, which are decoded again), the
dispatch size (`steps_per_sync`) and the attention path (the Pallas kernel, the ragged XLA
path, the dense cache). This module decodes fixed requests (prompts and keys) under each
condition with `offline.generate_rollouts`, compares each run with a reference run token by
token (`compare`), and measures the precision mismatch of the same requests beside it
(`precision_mismatch`: the bf16 rollout's log mu_S against the float32 trainer's log pi_S on the
same tokens). `tests/test_engine_invariance.py` asserts on it; `benchmarks/engine_invariance.py`
prints the table of docs/design.md section 3 ("The engine's own mismatch").

Requests are (prompt, key) pairs with one sample each: request r has prompt `prompts[r]` and the
key `fold_in(rng, BASE_INDEX + r)` (`generate_rollouts`' `first_prompt_index`), so the same
request can be decoded alone, behind other requests, or among all of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dvp_jax.dvp.pruning import pruned_token_logprobs
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import RolloutBatch, generate_rollouts

# Request r's key is fold_in(rng, BASE_INDEX + r): room for filler requests in front of it.
BASE_INDEX = 64
# The per-token log-probs compared (the sampler's E2-E4 records).
LOGP_FIELDS = ("behaviour_logp", "behaviour_logp_full", "behaviour_pruned_mass")


def rollouts(engine: RolloutEngine, prompts: Sequence, rng: jax.Array, **kw) -> RolloutBatch:
    """All requests through the engine's slots at once (continuous batching), one sample each;
    `kw` goes to `generate_rollouts` (e.g. `steps_per_sync`, `stats`)."""
    return generate_rollouts(engine, prompts, 1, rng, first_prompt_index=BASE_INDEX, **kw)


def placed_rollouts(
    engine: RolloutEngine, prompts: Sequence, rng: jax.Array, fillers: int = 0
) -> RolloutBatch:
    """Each request decoded in its own run, behind `fillers` other requests (other prompts,
    other keys) that the scheduler admits first: `fillers` = 0 decodes it alone in slot 0,
    `fillers` = j < slots in slot j with j slots busy beside it. Rows as `rollouts`."""
    if not 0 <= fillers < engine.max_concurrent_decodes:
        raise ValueError(
            f"fillers must be in [0, max_concurrent_decodes={engine.max_concurrent_decodes}), "
            f"got {fillers}"
        )
    n = len(prompts)
    parts = []
    for r in range(n):
        front = [prompts[(r + 1 + i) % n] for i in range(fillers)]
        batch = generate_rollouts(
            engine, front + [prompts[r]], 1, rng, first_prompt_index=BASE_INDEX + r - fillers
        )
        parts.append((batch, fillers))
    fields = {
        f.name: np.stack([getattr(b, f.name)[row] for b, row in parts])
        for f in dataclasses.fields(RolloutBatch)
        if getattr(parts[0][0], f.name) is not None  # (no weight versions: one version)
    }
    fields["prompt_index"] = np.arange(n, dtype=np.int32)
    return RolloutBatch(**fields)


def compare(ref: RolloutBatch, other: RolloutBatch) -> dict:
    """How `other` differs from `ref` (the same requests, row for row).

    A token is sampled identically when both runs made the same tokens up to and including it
    (the same context and the same draw); log-prob differences are taken over those tokens.

    Returns:
      tokens_equal: every token of every row equal.
      bitwise_equal: tokens equal and every log-prob record (`LOGP_FIELDS`) bit for bit.
      diverged: rows whose tokens differ somewhere (the first-divergence count), of `rows`.
      max_dlogp, mean_dlogp: max / mean |delta log mu_S| over the tokens sampled identically.
      max_dlogp_full: max |delta log mu| over them.
      compared: how many tokens that is.
    """
    if ref.tokens.shape != other.tokens.shape:
        raise ValueError(f"compare: shapes differ, {ref.tokens.shape} vs {other.tokens.shape}")
    differ = (ref.tokens != other.tokens) | (ref.response_mask != other.response_mask)
    same_so_far = np.cumsum(differ, axis=1) == 0
    mask = ref.response_mask & other.response_mask & same_so_far
    delta = lambda f: np.abs(getattr(ref, f)[mask] - getattr(other, f)[mask]).astype(np.float64)
    d, d_full = delta("behaviour_logp"), delta("behaviour_logp_full")
    tokens_equal = not differ.any()
    return dict(
        tokens_equal=bool(tokens_equal),
        bitwise_equal=bool(
            tokens_equal
            and all(np.array_equal(getattr(ref, f), getattr(other, f)) for f in LOGP_FIELDS)
        ),
        diverged=int(differ.any(axis=1).sum()),
        rows=int(ref.num_rows),
        max_dlogp=float(d.max()) if d.size else 0.0,
        mean_dlogp=float(d.mean()) if d.size else 0.0,
        max_dlogp_full=float(d_full.max()) if d_full.size else 0.0,
        compared=int(mask.sum()),
    )


@functools.partial(jax.jit, static_argnums=(0, 4))
def _teacher_forced_logp(graphdef, state, tokens, valid, log_rho):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = nnx.merge(graphdef, state)(tokens, positions, valid)[:, :-1]
    return pruned_token_logprobs(logits, tokens[:, 1:], log_rho)


def precision_mismatch(trainer, batch: RolloutBatch, log_rho: float) -> dict:
    """|log mu_S - log pi_S| of the batch's tokens: the rollout's behaviour log-prob against
    the trainer's (`trainer`, e.g. the float32 master `Transformer`: a full forward over the
    same tokens and its own pruning, E2), over response tokens in the trainer's safe set.

    Returns:
      max_abs, mean_abs: of |log mu_S - log pi_S|; tokens: how many.
    """
    graphdef, state = nnx.split(trainer)
    valid = jnp.asarray(batch.prompt_mask | batch.response_mask)
    tf = _teacher_forced_logp(graphdef, state, jnp.asarray(batch.tokens), valid, log_rho)
    mask = batch.response_mask[:, 1:] & np.asarray(tf.in_safe)
    diff = np.abs(np.asarray(tf.logp)[mask] - batch.behaviour_logp[:, 1:][mask])
    diff = diff.astype(np.float64)
    return dict(max_abs=float(diff.max()), mean_abs=float(diff.mean()), tokens=int(mask.sum()))


# The conditions `measure` knows, each against the reference run: the base config on the ragged
# XLA path ("paged_xla"), every request through the slots at once, sized dispatches, a full pool.
CONDITIONS = {
    "alone": "each request alone in the engine (slot 0, no other slot busy)",
    "last_slot": "each request in the last slot, behind B - 1 other requests",
    "steps_per_sync_1": "one decode step per dispatch (the step program, not the loop)",
    "short_pool": "a short pool (`short_pages`): other page ids, evictions, re-decoding",
    "dense": 'the dense cache (decode_attention="dense")',
    "kernel": "the Pallas paged kernel (interpret mode off TPU)",
}


def measure(
    model_cfg,
    trainer,
    base: EngineConfig,
    prompts: Sequence,
    rng: jax.Array,
    conditions: Sequence[str] = tuple(CONDITIONS),
    short_pages: int | None = None,
) -> dict:
    """Decodes `prompts` (one request each) under each of `conditions` and compares with the
    reference run (`CONDITIONS`).

    Args:
      model_cfg: the architecture.
      trainer: the trainer model (e.g. the float32 master `Transformer`): the engines take its
        weights, and `precision_mismatch` of each run is measured against it.
      base: the engine config (its dtype, sizes and sampling); decode_attention is set per run.
      prompts: the requests' prompts (more than `base.max_concurrent_decodes`, so slots are
        refilled).
      rng: the batch key.
      conditions: names from `CONDITIONS`.
      short_pages: the short pool's pages (`EngineConfig.kv_pages`), for "short_pool".
    Returns:
      {"reference": {"precision": ..., "evictions": ...}, name: `compare(...)` with
      "precision" (that run's own `precision_mismatch`) and "evictions" added, ...}.
    """
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        raise ValueError(f"measure: conditions {unknown} unknown; allowed {tuple(CONDITIONS)}")
    params = nnx.state(trainer)
    engine = lambda impl=None, **kw: RolloutEngine(
        model_cfg,
        dataclasses.replace(base, **{"decode_attention": "paged_xla", **kw}),
        params=params,
        paged_impl=impl,
    )

    def run(eng, **kw):
        stats = []
        batch = rollouts(eng, prompts, rng, stats=stats, **kw)
        return batch, stats[0].evictions

    xla = engine()
    ref, evictions = run(xla)
    mismatch = lambda b: precision_mismatch(trainer, b, base.log_rho)
    out = {"reference": {"precision": mismatch(ref), "evictions": evictions}}
    for name in conditions:
        evictions = 0
        if name == "alone":
            batch = placed_rollouts(xla, prompts, rng, fillers=0)
        elif name == "last_slot":
            batch = placed_rollouts(xla, prompts, rng, fillers=base.max_concurrent_decodes - 1)
        elif name == "steps_per_sync_1":
            batch, evictions = run(xla, steps_per_sync=1)
        elif name == "short_pool":
            if short_pages is None:
                raise ValueError("measure: the short_pool condition needs short_pages")
            batch, evictions = run(engine(kv_pages=short_pages))
        elif name == "dense":
            batch, evictions = run(engine(decode_attention="dense"))
        else:
            batch, evictions = run(engine("kernel"))
        out[name] = {**compare(ref, batch), "precision": mismatch(batch), "evictions": evictions}
    return out
