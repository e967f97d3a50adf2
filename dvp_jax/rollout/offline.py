"""RL rollouts on the RL engine: P prompts x G samples -> a fixed-shape `RolloutBatch`.

JetStream's orchestrator returns no log-probs and cannot swap weights, so the RL loop drives
`RolloutEngine` itself (docs/design.md section 3): each prompt is prefilled once (the prompts of
a refill in one `prefill_batch` call per length bucket) and inserted into G slots with sample
indices 0..G-1 (`insert_batch`); whenever a slot finishes its record is copied out and the next
(prompt, sample) pair takes it (continuous batching). Which pair takes which slot, which slots
yield their pages when the pool runs short, and how many steps each dispatch of
`generate_steps` runs over what span are the scheduler's decisions (`scheduler.py`). The engine's
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
from dvp_jax.rollout.scheduler import Limits, Scheduler, Stats


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
      behaviour_version: [N, T] int32, the weight version (RL step) each response token was
        sampled under (partial rollouts, `partial.py`); None: every token this step's.
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
    behaviour_version: np.ndarray | None = None
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
    steps_per_sync: int | None = None,
    first_prompt_index: int = 0,
    should_stop: Callable[[], bool] | None = None,
    stats: list[Stats] | None = None,
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
      steps_per_sync: None (the default) sizes each dispatch (`scheduler.py`: as many steps as
        keep its read span and pages, at least `scheduler.MIN_STEPS`); k runs every dispatch up
        to k steps. A dispatch ends on the device after the step in which a slot finishes
        while requests wait, so a finished slot is refilled at once whatever its size; longer
        dispatches save dispatch and sync latency. Tokens are the same for every value
        (log-probs to float rounding).
      should_stop: asked between dispatches; True abandons the batch (`RolloutInterrupted`),
        so a preemption is honoured within one dispatch.
      first_prompt_index: the global index of `prompts[0]`: prompt p's key is
        `fold_in(rng, first_prompt_index + p)`, so a batch split over hosts (each passing the
        offset of its share) samples exactly what one host sampling the whole batch would.
      stats: if given, the schedule's `scheduler.Stats` (decode steps, dispatches, evictions)
        is appended to it.
    Returns:
      A `RolloutBatch` with N = P * G rows.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if steps_per_sync is not None and steps_per_sync < 1:
        raise ValueError(f"steps_per_sync must be None or >= 1, got {steps_per_sync}")
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
        tokens[p * g_size : (p + 1) * g_size, : ids.size] = ids

    prompt_lengths[:] = np.repeat([ids.size for ids in token_lists], g_size)
    stop = np.asarray(engine.stop_tokens, np.int32)
    # Prompt p's key fold_in(rng, first_prompt_index + p), all at once (raw [P, 2] on the host).
    prompt_keys = np.asarray(
        jax.device_get(
            jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(rng, i)))(
                first_prompt_index + np.arange(n_prompts, dtype=np.int32)
            )
        )
    )
    # Request i = p * G + g is row i; the scheduler decides admission, pages, evictions and
    # each dispatch's size (`scheduler.py`), the loop below only carries its decisions out.
    limits = Limits.from_engine(engine, steps_per_sync)
    sched = Scheduler(limits, prompt_lengths)
    prefixes: dict[int, tuple] = {}  # p -> (batched Prefix, its row) while p has pairs waiting

    def harvest(state, ended):
        host = jax.device_get({f: getattr(state, f) for f in RECORD_FIELDS + ("step",)})
        for slot, i in ended:
            r = int(host["step"][slot])
            cols = slice(prompt_lengths[i], prompt_lengths[i] + r)
            for f in RECORD_FIELDS:
                records[f][i, cols] = host[f][slot, :r]
            response_lengths[i] = r
            finished[i] = r > 0 and bool(np.isin(host["tokens"][slot, r - 1], stop))

    def insert(state, admit):
        """The admitted (slot, request) pairs: new prompts prefilled in one call per prompt
        bucket, then one insert per prefill batch."""
        new = sorted({i // g_size for _, i in admit} - set(prefixes))
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
        for slot, i in admit:
            prefix, row = prefixes[i // g_size]
            _, slots, rows, samples = inserts.setdefault(id(prefix), (prefix, [], [], []))
            slots.append(slot)
            rows.append(row)
            samples.append(i % g_size)
        for prefix, slots, rows, samples in inserts.values():
            state = engine.insert_batch(prefix, state, slots, rows, samples)
        # A prompt's prefix is kept while one of its pairs waits (an evicted pair included).
        waiting = {i // g_size for i in sched.pending}
        for p in [p for p in prefixes if p not in waiting]:
            del prefixes[p]
        return state

    while not sched.done():
        if should_stop is not None and should_stop():
            raise RolloutInterrupted("rollouts abandoned: a stop was requested")
        dispatch = sched.plan()
        if dispatch.evict:
            state = engine.evict(state, dispatch.evict)
        if dispatch.admit:
            state = insert(state, dispatch.admit)
        if dispatch.num_steps:
            state = engine.generate_steps(
                params, state, dispatch.num_steps, dispatch.span, dispatch.stop_at_finish
            )
        # The one host sync per dispatch: where each slot stands, which are done.
        step, done, pool = jax.device_get((state.step, state.done, state.pages))
        ended = sched.observe(step, done, None if pool is None else pool.preempted)
        if ended:
            harvest(state, ended)
    if stats is not None:
        stats.append(sched.stats)

    return _batch(records, prompt_lengths, response_lengths, finished, g_size)


def _batch(records, prompt_lengths, response_lengths, finished, g_size) -> RolloutBatch:
    """The `RolloutBatch` of `[N, T]` records laid out by row (`RolloutBatch`'s docstring)."""
    t = records["tokens"].shape[1]
    positions = np.arange(t)[None, :]
    prompt_mask = positions < prompt_lengths[:, None]
    response_mask = ~prompt_mask & (positions < (prompt_lengths + response_lengths)[:, None])
    rows = np.arange(len(prompt_lengths))
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


def assemble(
    prompts: Sequence[np.ndarray],
    responses: Sequence[dict[str, np.ndarray]],
    g_size: int,
    t: int,
    stop_tokens: Sequence[int],
) -> RolloutBatch:
    """A `RolloutBatch` of rows given one by one: row i is `prompts[i]` then the response whose
    records (`RECORD_FIELDS` -> `[R_i, ...]`) are `responses[i]`, padded to `t` columns; a
    response finished if it ends with one of `stop_tokens` (else it was cut at the cap)."""
    n = len(prompts)
    records = {
        f: np.zeros((n, t) + responses[0][f].shape[1:], responses[0][f].dtype)
        for f in RECORD_FIELDS
    }
    prompt_lengths = np.asarray([p.size for p in prompts], np.int32)
    response_lengths = np.asarray([len(r["tokens"]) for r in responses], np.int32)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        records["tokens"][i, : prompt.size] = prompt
        cols = slice(prompt.size, prompt.size + response_lengths[i])
        for f in RECORD_FIELDS:
            records[f][i, cols] = response[f]
    last = [r["tokens"][-1] if len(r["tokens"]) else -1 for r in responses]
    finished = np.isin(np.asarray(last), np.asarray(stop_tokens, np.int64)) & (response_lengths > 0)
    return _batch(records, prompt_lengths, response_lengths, finished, g_size)
