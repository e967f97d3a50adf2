"""RL rollouts on the RL engine: P prompts x G samples -> a fixed-shape `RolloutBatch`.

JetStream's orchestrator returns no log-probs and cannot swap weights, so the RL loop drives
`RolloutEngine` itself (docs/design.md section 3): each prompt is prefilled once (the prompts of
a refill in one `prefill_batch` call per length bucket) and inserted into G slots with sample
indices 0..G-1 (`insert_batch`); whenever a slot finishes its record is copied out and the next
(prompt, sample) pair takes it (continuous batching); each dispatch of `generate_steps` attends
over the smallest `kv_buckets` length above every occupied slot's position. The engine's
per-token records (`RECORD_FIELDS`, E4) are laid out under the same names as `[N, T]` arrays
(row `p * G + g`). Keys depend on (prompt, sample, step) only, so a seed reproduces a batch.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from dvp_jax.rollout.engine import RECORD_FIELDS, RolloutEngine
from dvp_jax.rollout.sampling import SamplingParams

# Decode steps per dispatch of the RL loop (`generate_rollouts(steps_per_sync=)`): one compiled
# loop of this many steps between host checks.
STEPS_PER_SYNC = 8


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """P prompts x G responses as fixed-shape host arrays (N = P * G rows, T columns).

    Row `i = p * G + g` holds prompt `p` on columns `[0, Lp)`, its g-th response on
    `[Lp, Lp + R)` and padding (token 0) after. A response includes its final stop token.
    The per-token statistics sit at the column of the token they describe, e.g.
    `behaviour_logp[i, t] = log mu_S(tokens[i, t] | tokens[i, :t])` where
    `response_mask[i, t]`, and 0 elsewhere. The `behaviour_*` fields are the sampler's
    `pruning.TokenLogprobs` (E2-E4, docs/design.md section 2) with the rollout-side prefix; the
    trainer's own values of the same quantities drop it (`logp`, `logp_full`, ...).

    Attributes:
      tokens: [N, T] int32.
      prompt_mask: [N, T] bool, True on prompt tokens.
      response_mask: [N, T] bool, True on generated tokens.
      behaviour_logp: [N, T] float32, log mu_S (E4, the pruned rollout distribution).
      behaviour_logp_full: [N, T] float32, log mu (rollout logits, no pruning).
      behaviour_pruned_mass: [N, T] float32, delta_S of the rollout's safe set (E3).
      behaviour_safe_size: [N, T] int32, |V_S| of the rollout's safe set (E1).
      prompt_index: [N] int32, p.
      group_index: [N] int32, g (sample index within the prompt's group).
      prompt_lengths: [N] int32, Lp.
      response_lengths: [N] int32, R.
      finished: [N] bool, True if the response ended with a stop token (else it was cut at
        `max_decode_length`).
      behaviour_kept_ids: [N, T, W] int32, the truncation set K of each token (E13; -1 padded,
        all -1 where untruncated; W = 0 without top-k / top-p; None given: W = 0).
      behaviour_truncated_mass: [N, T] float32, mu's mass outside K (E13; None given: 0).
    """

    tokens: np.ndarray
    prompt_mask: np.ndarray
    response_mask: np.ndarray
    behaviour_logp: np.ndarray
    behaviour_logp_full: np.ndarray
    behaviour_pruned_mass: np.ndarray
    behaviour_safe_size: np.ndarray
    prompt_index: np.ndarray
    group_index: np.ndarray
    prompt_lengths: np.ndarray
    response_lengths: np.ndarray
    finished: np.ndarray
    behaviour_kept_ids: np.ndarray | None = None
    behaviour_truncated_mass: np.ndarray | None = None

    def __post_init__(self):
        # Built without truncation records (no top-k / top-p): zero-width kept sets, no mass.
        n, t = self.tokens.shape
        if self.behaviour_kept_ids is None:
            object.__setattr__(self, "behaviour_kept_ids", np.zeros((n, t, 0), np.int32))
        if self.behaviour_truncated_mass is None:
            object.__setattr__(self, "behaviour_truncated_mass", np.zeros((n, t), np.float32))

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def response(self, i: int) -> np.ndarray:
        """The generated token ids of row i."""
        start = self.prompt_lengths[i]
        return self.tokens[i, start : start + self.response_lengths[i]]


class RolloutInterrupted(Exception):
    """`generate_rollouts` was asked to stop (`should_stop`) before the batch was complete."""


def _as_token_lists(engine: RolloutEngine, prompts: Sequence, prompt_len: int) -> list[np.ndarray]:
    tok = engine.tokenizer
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = ([tok.bos_id] if getattr(tok, "add_bos", True) else []) + list(
                tok.encode_ids(prompt)
            )
        else:
            ids = list(prompt)
        ids = np.asarray(ids, np.int64)
        if ids.size == 0:
            raise ValueError(f"prompt {i} is empty")
        if ids.size > prompt_len:
            raise ValueError(
                f"prompt {i} has {ids.size} tokens, more than prompt_len={prompt_len} "
                f"(max_prefill_length={engine.max_prefill_length})"
            )
        vocab = engine.model_cfg.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        out.append(ids.astype(np.int32))
    return out


def generate_rollouts(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int] | str],
    num_samples: int,
    rng: jax.Array,
    *,
    params: nnx.State | None = None,
    sampling: SamplingParams | None = None,
    prompt_len: int | None = None,
    steps_per_sync: int = STEPS_PER_SYNC,
    first_prompt_index: int = 0,
    should_stop: Callable[[], bool] | None = None,
) -> RolloutBatch:
    """Samples `num_samples` responses for each prompt (E4) with continuous batching.

    Args:
      engine: the rollout engine.
      prompts: P prompts, each a sequence of token ids (BOS included if wanted) or a string
        (encoded with the engine's tokenizer, BOS prepended if the tokenizer adds one).
      num_samples: G >= 1 responses per prompt.
      rng: PRNG key of this rollout batch (e.g. `fold_in(key, train_step)`).
      params: rollout params; default `engine.load_params()`.
      sampling: sampling parameters; default the engine config's.
      prompt_len: prompt columns of the output; default `engine.max_prefill_length` (fixed
        shapes across batches for the jitted train step).
      steps_per_sync: at most this many decode steps per dispatch and host check
        (`engine.generate_steps`). A dispatch ends on the device after the step in which a slot
        finishes while prompts wait, so a finished slot is refilled at once whatever k; k > 1
        saves the per-step dispatch and sync latency, at the cost of attending over a length
        bucket that covers k more positions. Tokens are the same for every value (log-probs to
        float rounding).
      should_stop: asked between dispatches; True abandons the batch (`RolloutInterrupted`),
        so a preemption is honoured within one dispatch.
      first_prompt_index: the global index of `prompts[0]`: prompt p's key is
        `fold_in(rng, first_prompt_index + p)`, so a batch split over hosts (each passing the
        offset of its share) samples exactly what one host sampling the whole batch would.
    Returns:
      A `RolloutBatch` with N = P * G rows.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if steps_per_sync < 1:
        raise ValueError(f"steps_per_sync must be >= 1, got {steps_per_sync}")
    params = engine.load_params() if params is None else params
    prompt_len = engine.max_prefill_length if prompt_len is None else int(prompt_len)
    if not 1 <= prompt_len <= engine.max_prefill_length:
        raise ValueError(
            f"prompt_len must be in [1, max_prefill_length={engine.max_prefill_length}], "
            f"got {prompt_len}"
        )
    token_lists = _as_token_lists(engine, prompts, prompt_len)
    n_prompts, g_size, m = len(token_lists), num_samples, engine.max_decode_length
    n, t = n_prompts * g_size, prompt_len + m

    state = engine.init_decode_state(sampling=sampling)
    # One [N, T] host array per engine record (`RECORD_FIELDS`), in the record's dtype.
    records = {
        f: np.zeros((n, t) + getattr(state, f).shape[2:], getattr(state, f).dtype)
        for f in RECORD_FIELDS
    }
    tokens = records["tokens"]
    prompt_lengths = np.zeros((n,), np.int32)
    response_lengths = np.zeros((n,), np.int32)
    finished = np.zeros((n,), bool)
    for p, ids in enumerate(token_lists):
        rows = slice(p * g_size, (p + 1) * g_size)
        tokens[rows, : ids.size] = ids
        prompt_lengths[rows] = ids.size

    stop = np.asarray(engine.stop_tokens, np.int32)
    # Prompt p's key fold_in(rng, first_prompt_index + p), all at once (raw [P, 2] on the host).
    prompt_keys = np.asarray(
        jax.device_get(
            jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(rng, i)))(
                first_prompt_index + np.arange(n_prompts, dtype=np.int32)
            )
        )
    )
    pending = collections.deque((p, g) for p in range(n_prompts) for g in range(g_size))
    waiting = collections.Counter(p for p, _ in pending)  # pairs of each prompt in `pending`
    prefixes: dict[int, tuple] = {}  # p -> (batched Prefix, its row) while p has pairs waiting
    owner: list[tuple[int, int] | None] = [None] * engine.max_concurrent_decodes
    # Each occupied slot's position as of the last sync (the decode's length bucket).
    slot_pos = np.zeros((engine.max_concurrent_decodes,), np.int64)

    def harvest(state, slots):
        host = jax.device_get({f: getattr(state, f) for f in RECORD_FIELDS + ("step",)})
        for slot in slots:
            p, g = owner[slot]
            i, r = p * g_size + g, int(host["step"][slot])
            cols = slice(prompt_lengths[i], prompt_lengths[i] + r)
            for f in RECORD_FIELDS:
                records[f][i, cols] = host[f][slot, :r]
            response_lengths[i] = r
            finished[i] = r > 0 and bool(np.isin(host["tokens"][slot, r - 1], stop))
            owner[slot] = None

    cfg = engine.config
    pages_of = lambda positions: -(-np.asarray(positions) // cfg.page_size)
    free_pages = cfg.num_pages  # as of the last sync

    def admitted(free):
        """How many of the next pairs fit in the free slots `free` and, on a paged cache, in
        the free pages (each needs its prompt and the next dispatch's pages; the occupied
        slots keep room for theirs): the pool is never overcommitted at admission."""
        count = min(len(free), len(pending))
        if not cfg.paged or cfg.kv_pages is None:
            return count
        occupied = np.array([o is not None for o in owner])
        spare = free_pages - int(
            np.sum(pages_of(slot_pos[occupied] + steps_per_sync) - pages_of(slot_pos[occupied]))
        )
        for i in range(count):
            spare -= int(pages_of(token_lists[pending[i][0]].size + steps_per_sync))
            if spare < 0:
                return i
        return count

    def refill(state):
        """Fills free slots with the next (prompt, sample) pairs: new prompts prefilled in
        one call per prompt bucket, then one insert per prefill batch."""
        free = [s for s, o in enumerate(owner) if o is None]
        free = free[: admitted(free)]
        pairs = [pending.popleft() for _ in free]
        new = sorted({p for p, _ in pairs if p not in prefixes})
        by_bucket = collections.defaultdict(list)
        for p in new:
            by_bucket[engine.bucket(token_lists[p].size)].append(p)
        for group in by_bucket.values():
            prefix = engine.prefill_batch(
                params, [token_lists[p] for p in group], prompt_keys[group]
            )
            for row, p in enumerate(group):
                prefixes[p] = (prefix, row)
        inserts = {}  # id(prefix) -> (prefix, slots, rows, sample indices)
        for slot, (p, g) in zip(free, pairs, strict=True):
            prefix, row = prefixes[p]
            _, slots, rows, samples = inserts.setdefault(id(prefix), (prefix, [], [], []))
            slots.append(slot)
            rows.append(row)
            samples.append(g)
            waiting[p] -= 1
            if waiting[p] == 0:
                del prefixes[p]
            owner[slot] = (p, g)
            slot_pos[slot] = token_lists[p].size
        for prefix, slots, rows, samples in inserts.values():
            state = engine.insert_batch(prefix, state, slots, rows, samples)
        return state

    while pending or any(o is not None for o in owner):
        if should_stop is not None and should_stop():
            raise RolloutInterrupted("rollouts abandoned: a stop was requested")
        if pending and None in owner:
            state = refill(state)
        occupied = np.array([o is not None for o in owner])
        # Attention reads the live prefix: every active slot writes below pos + steps_per_sync
        # (dense: one length bucket for all; paged: the slots' pages together).
        kv_len = int(slot_pos[occupied].max()) + steps_per_sync
        live = int(np.sum(pages_of(slot_pos[occupied] + steps_per_sync)))
        state = engine.generate_steps(
            params,
            state,
            steps_per_sync,
            kv_len=kv_len,
            stop_at_finish=bool(pending),
            live_pages=live,
        )
        # The one host sync per dispatch: which slots are done, and where each slot stands.
        done, pos, pool = jax.device_get((state.done, state.pos, state.pages))
        slot_pos[occupied] = pos[occupied]
        if pool is not None:
            free_pages = int(np.sum(~pool.used))
            # A slot the pool could not serve gives its pair back: decoded again from its
            # start, with the same keys, so the same tokens.
            for s in np.flatnonzero(pool.preempted & occupied)[::-1]:
                p, g = owner[s]
                pending.appendleft((p, g))
                waiting[p] += 1
                owner[s] = None
        ended = [s for s, o in enumerate(owner) if o is not None and done[s]]
        if ended:
            harvest(state, ended)

    positions = np.arange(t)[None, :]
    prompt_mask = positions < prompt_lengths[:, None]
    response_mask = ~prompt_mask & (positions < (prompt_lengths + response_lengths)[:, None])
    rows = np.arange(n)
    return RolloutBatch(
        **records,  # tokens and the behaviour_* statistics
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        prompt_index=(rows // g_size).astype(np.int32),
        group_index=(rows % g_size).astype(np.int32),
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        finished=finished,
    )
