"""The rollout's device programs as pure functions: empty state, prefill, insert, step, loop.

Each takes the model (or its settings), the state and the static sizes as arguments and returns
new arrays; nothing here holds state or calls `jax.jit`: `engine.RolloutEngine` jits each once
with its shardings, and `dvp_jax.aot` compiles those jitted programs for a TPU topology. The
sampling step itself (E1-E4) is `sampling.sample`; the state's fields are documented on
`state.DecodeState` and `state.Prefix`. Keys depend only on (request key, sample index, step),
never on the slot or the schedule, so a fixed seed reproduces a rollout exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dvp_jax.model import paged
from dvp_jax.model.config import ModelConfig
from dvp_jax.model.kv_cache import KVCache, cache_storage, seq_axis, to_storage
from dvp_jax.model.transformer import Transformer
from dvp_jax.rollout import sampling
from dvp_jax.rollout.state import RECORD_FIELDS, DecodeState, Prefix


def raw_key_shape() -> tuple[int, ...]:
    """The shape of one raw PRNG key (`[2]` for JAX's default threefry keys)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def key_data(key: jax.Array) -> jax.Array:
    """Raw uint32 key data of a typed key or of raw key data."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32)


def fold_key(raw_key: jax.Array, value: jax.Array) -> jax.Array:
    """Raw key data of `fold_in(raw_key, value)` (a slot's key: its request's, folded with the
    sample index)."""
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(raw_key), value))


def empty_state(
    model_cfg: ModelConfig,
    slots: int,
    max_decode_length: int,
    cache_length: int,
    cache_dtype,
    layout: str,
    params: sampling.SamplingParams,
    pool: tuple[int, int] | None = None,
    kept_width: int = 0,
) -> DecodeState:
    """`slots` empty (done) slots with a zero cache of `cache_length` positions per slot, or,
    with `pool` = (pages, page_size), a paged cache of that many pages, all free; `kept_width`
    kept ids per token (E13, `EngineConfig.kept_width`)."""
    b, m = slots, max_decode_length
    storage = cache_storage(cache_dtype)
    if pool is None:
        cache, pages = KVCache.zeros(model_cfg, b, cache_length, storage, layout), None
    else:
        num_pages, page_size = pool
        shape = paged.paged_cache_shape(model_cfg, num_pages, page_size)
        cache = KVCache(jnp.zeros(shape, storage), jnp.zeros(shape, storage))
        pages = paged.Pages.empty(b, -(-cache_length // page_size), num_pages)
    return DecodeState(
        cache=cache,
        pages=pages,
        logits=jnp.zeros((b, model_cfg.vocab_size), jnp.float32),
        pos=jnp.zeros((b,), jnp.int32),
        step=jnp.zeros((b,), jnp.int32),
        done=jnp.ones((b,), bool),
        key=jnp.zeros((b,) + raw_key_shape(), jnp.uint32),
        context=jnp.zeros((b,), jnp.uint32),
        tokens=jnp.zeros((b, m), jnp.int32),
        behaviour_logp=jnp.zeros((b, m), jnp.float32),
        behaviour_logp_full=jnp.zeros((b, m), jnp.float32),
        behaviour_pruned_mass=jnp.zeros((b, m), jnp.float32),
        behaviour_safe_size=jnp.zeros((b, m), jnp.int32),
        behaviour_kept_ids=jnp.zeros((b, m, kept_width), jnp.int32),
        behaviour_truncated_mass=jnp.zeros((b, m), jnp.float32),
        sampling=params,
    )


def prefill(model: Transformer, tokens: jax.Array, lengths: jax.Array, keys: jax.Array) -> Prefix:
    """Runs right-padded prompts `tokens` [rows, bucket] of true `lengths` [rows] (raw `keys`
    [rows, 2]); the prefix's cache holds `bucket` positions."""
    logits, cache = model.prefill(tokens, lengths, cache_len=tokens.shape[1])
    context = sampling.context_hash(tokens, lengths)  # fixes the logit noise (sampling.py)
    return Prefix(
        cache=cache, logits=logits, length=lengths, key=keys, context=context, tokens=tokens
    )


def insert(
    prefix: Prefix,
    state: DecodeState,
    slots: jax.Array,
    rows: jax.Array,
    sample_index: jax.Array,
    cache_dtype,
    layout: str,
    resume_steps: jax.Array | None = None,
) -> DecodeState:
    """Puts prefix row `rows[i]` into slot `slots[i]` with the key `fold_in(prefix key,
    sample_index[i])`; a slot index past the last slot (padding) is dropped. On a paged cache
    the slot's old pages return to the pool and it takes ceil(prompt length / page_size).

    With `resume_steps` ([B] per insertion) the prefix is a preempted response's prompt and
    its first `resume_steps[i]` generated tokens, prefilled again, and its key is the slot's
    own (unfolded): the slot goes on at step `resume_steps[i]` with its records kept, so it
    samples what it would have sampled without the preemption (keys depend on the step, the
    logit noise on the context hash of the same tokens)."""
    if state.pages is not None:
        state = _insert_pages(prefix, state, slots, rows, cache_dtype, layout)
        cache = state.cache
    else:
        cache = _insert_rows(prefix, state.cache, slots, rows, cache_dtype, layout)
    set_rows = lambda a, v: a.at[slots].set(v, mode="drop")
    if resume_steps is None:
        keys, steps = jax.vmap(fold_key)(prefix.key[rows], sample_index), 0
        records = {f: set_rows(getattr(state, f), 0) for f in RECORD_FIELDS}
    else:
        keys, steps, records = prefix.key[rows], resume_steps, {}
    return state.replace(
        cache=cache,
        logits=set_rows(state.logits, prefix.logits[rows]),
        pos=set_rows(state.pos, prefix.length[rows]),
        step=set_rows(state.step, steps),
        done=set_rows(state.done, False) | _preempted(state),
        key=set_rows(state.key, keys),
        context=set_rows(state.context, prefix.context[rows]),
        **records,
    )


def _preempted(state: DecodeState) -> jax.Array:
    """[B] bool slots stopped for want of a page (all False on a dense cache)."""
    if state.pages is None:
        return jnp.zeros(state.done.shape, bool)
    return state.pages.preempted


def _insert_rows(prefix: Prefix, cache: KVCache, slots, rows, cache_dtype, layout) -> KVCache:
    """Prefix rows into the dense cache's slot rows (positions `[0, bucket)`)."""
    bucket = prefix.cache.k.shape[seq_axis(layout)]
    # [:, slots, :, :bucket] heads first, [:, slots, :bucket] positions first.
    index = (slice(None), slots) + (slice(None),) * (seq_axis(layout) - 2)

    def put(buf, value):  # buf in the cache storage dtype (`kv_cache.cache_storage`)
        value = to_storage(value[:, rows], cache_dtype)
        return buf.at[index + (slice(None, bucket),)].set(value, mode="drop")

    return KVCache(put(cache.k, prefix.cache.k), put(cache.v, prefix.cache.v))


def _insert_pages(prefix: Prefix, state: DecodeState, slots, rows, cache_dtype, layout):
    """Frees the slots' pages, takes pages for the prompts and copies the prompts into them; a
    slot the pool cannot serve is marked preempted (the host admits only what fits)."""
    b, (num_pages, page_size) = state.pos.shape[0], state.cache.k.shape[1:3]
    k_pre, v_pre = prefix.cache
    if layout == "heads_first":  # [L, rows, k, bucket, h] -> [L, rows, bucket, k, h]
        k_pre, v_pre = (jnp.swapaxes(x, 2, 3) for x in (k_pre, v_pre))
    bucket = k_pre.shape[2]
    n = -(-bucket // page_size)  # pages of the bucket
    target = jnp.zeros((b,), bool).at[slots].set(True, mode="drop")
    pages = paged.release(state.pages, target)
    length = jnp.zeros((b,), jnp.int32).at[slots].set(prefix.length[rows], mode="drop")
    column = jnp.arange(pages.table.shape[1])[None, :]
    want = target[:, None] & (column < -(-length // page_size)[:, None])
    pages, missed = paged.allocate(pages, want, most=min(b, slots.shape[0]) * n)
    pages = pages.replace(preempted=jnp.where(target, missed, pages.preempted))
    pages = paged.release(pages, missed)
    # Page ids [i, j] of insertion i's j-th page; past its prompt, or padding: dropped.
    ins = jnp.clip(slots, 0, b - 1)
    ids = pages.table[ins, :n]
    keep = (slots < b)[:, None] & (
        jnp.arange(n)[None, :] < -(-prefix.length[rows] // page_size)[:, None]
    )
    ids = jnp.where(keep & (ids >= 0), ids, num_pages)

    def put(buf, value):  # value [L, rows, bucket, k, h] -> pages [L, i, j, ps, k h]
        value = to_storage(value[:, rows], cache_dtype)
        pad = [(0, 0)] * 5
        pad[2] = (0, n * page_size - bucket)
        value = jnp.pad(value, pad)
        l_, i_, _, k_, h_ = value.shape
        return buf.at[:, ids].set(value.reshape(l_, i_, n, page_size, k_ * h_), mode="drop")

    return state.replace(
        cache=KVCache(put(state.cache.k, k_pre), put(state.cache.v, v_pre)), pages=pages
    )


def step(
    model: Transformer,
    state: DecodeState,
    kv_len: int,
    stop_tokens: tuple[int, ...],
    cache_length: int,
    paged_impl: str | None = None,
) -> tuple[DecodeState, jax.Array]:
    """One token for every active slot, and the decode step that gives its next logits.

    Samples from the slot's pending logits (E4, `sampling.sample` with the key
    `fold_in(slot key, step)`), records the token and the sampler's `pruning.TokenLogprobs`
    under the `behaviour_` names, then decodes it with attention over the first `kv_len`
    cache positions. A slot finishes at a stop token (recorded, counted in the length) or after
    M = `state.tokens.shape[1]` tokens.

    Returns:
      (the new state, [B, 3] int32 rows (token, valid, length): `valid` 0 for a slot that had
      already finished, `length` its generated tokens including this one).
    """
    b, m = state.tokens.shape
    pages = state.pages
    if pages is not None:
        page_size = state.cache.k.shape[2]
        column = jnp.arange(pages.table.shape[1])[None, :]
        want = ~state.done[:, None] & (column == (state.pos // page_size)[:, None])
        pages, missed = paged.allocate(pages, want, most=b)
        pages = pages.replace(preempted=pages.preempted | missed)
        state = state.replace(done=state.done | missed)
    active = ~state.done
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(
        state.key, state.step
    )
    # tokens [B] and their pruning.TokenLogprobs (E2-E4) under the slot's mu_S.
    width = state.behaviour_kept_ids.shape[-1]  # static: E13's kept set, 0 without truncation
    tokens, sampled, truncated = sampling.sample(
        keys, state.logits, state.sampling, state.context, kept_width=width
    )

    rows, col = jnp.arange(b), jnp.minimum(state.step, m - 1)

    def record(buf, value):
        live = active.reshape(active.shape + (1,) * (value.ndim - 1))
        return buf.at[rows, col].set(jnp.where(live, value, buf[rows, col]).astype(buf.dtype))

    new_step = state.step + active.astype(jnp.int32)
    stop = jnp.isin(tokens, jnp.asarray(stop_tokens, jnp.int32))
    done = state.done | (active & (stop | (new_step >= m)))
    if pages is None:
        logits, cache = model.decode(tokens, state.pos, state.cache, kv_len)
    else:
        lengths = jnp.where(active, state.pos + 1, 0)
        view = paged.PageView(pages.table, lengths, kv_len, paged_impl)
        logits, cache = model.decode(tokens, state.pos, state.cache, pages=view)
        pages = paged.release(pages, done)  # a finished slot's pages go back to the pool
    new_state = state.replace(
        pages=pages,
        cache=cache,
        logits=logits,
        pos=jnp.minimum(state.pos + active.astype(jnp.int32), cache_length - 1),
        step=new_step,
        done=done,
        context=jnp.where(active, sampling.extend_context(state.context, tokens), state.context),
        tokens=record(state.tokens, tokens),
        behaviour_logp=record(state.behaviour_logp, sampled.logp),
        behaviour_logp_full=record(state.behaviour_logp_full, sampled.logp_full),
        behaviour_pruned_mass=record(state.behaviour_pruned_mass, sampled.pruned_mass),
        behaviour_safe_size=record(state.behaviour_safe_size, sampled.safe_size),
        behaviour_kept_ids=record(state.behaviour_kept_ids, truncated.kept_ids),
        behaviour_truncated_mass=record(state.behaviour_truncated_mass, truncated.truncated_mass),
    )
    return new_state, jnp.stack([tokens, active.astype(jnp.int32), new_step], axis=-1)


def evict(state: DecodeState, slots: jax.Array) -> DecodeState:
    """Stops the slots where `slots` ([B] bool) is True and returns their pages to the pool:
    the scheduler's preemption (`scheduler.py`); their records stay until the next insert."""
    pages = state.pages if state.pages is None else paged.release(state.pages, slots)
    return state.replace(done=state.done | slots, pages=pages)


def loop(
    model: Transformer,
    state: DecodeState,
    num_steps: jax.Array,
    kv_len: int,
    stop_at_finish: jax.Array,
    stop_tokens: tuple[int, ...],
    cache_length: int,
    paged_impl: str | None = None,
) -> DecodeState:
    """Up to `num_steps` (traced: one program for every count) `step`s in one while loop: it
    ends once every slot is done and, with `stop_at_finish` (a traced flag), after the step in
    which a slot active at the start finishes (so the host refills it at once instead of
    letting it idle). `kv_len` is the span's size (static): a dense length bucket or the
    ragged path's page bucket (`scheduler.Span`)."""
    was_done = state.done

    def cond(carry):
        i, st = carry
        finished = jnp.any(st.done & ~was_done)
        return (i < num_steps) & ~jnp.all(st.done) & ~(stop_at_finish & finished)

    def body(carry):
        i, st = carry
        return i + 1, step(model, st, kv_len, stop_tokens, cache_length, paged_impl)[0]

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]
