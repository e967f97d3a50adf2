"""Partial rollouts with over-sampling: a step takes the groups that finished and carries the
unfinished responses into the next step (`rollout.partial`; docs/design.md, "Partial rollouts").

A synchronous step decodes until its longest response ends, so every step runs as many decode
steps as the cap. Here up to `oversample` x P groups are in flight; a step's rollout ends when P
groups have every response finished (RLOO needs a prompt's G responses together: the
scheduler's `target_groups`), and the rest stay in flight: each unfinished response keeps its
tokens and per-token records and, at the next step, after the weight sync and ahead of new
prompts, is prefilled again (prompt + generated prefix, `RolloutEngine.resume_batch`) with the
new weights, so the KV always matches the weights that sample next. Its key and step go on, so
with weights that do not change between steps a carried response is token for token what an
uninterrupted rollout gives (float32).

Each token records the weight version it was sampled under (`RolloutBatch.behaviour_version`);
the behaviour log-probs stay the sampling-time log mu_S, so every correction applies as it is.
A response holding a token older than `max_staleness` versions is decoded again from its prompt
(same key) and counted. A group whose responses finished but is not taken this step waits, also
counted as carried. In-flight responses are not part of a checkpoint: a resumed run starts with
none (their prompts are not drawn again), and says how many it dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from dvp_jax.rollout.decode import fold_key
from dvp_jax.rollout.engine import RECORD_FIELDS, RolloutEngine
from dvp_jax.rollout.offline import RolloutBatch, RolloutInterrupted, assemble
from dvp_jax.rollout.scheduler import Limits, Scheduler

# A group's G response keys from its prompt's key, in one compiled call (eager vmap re-traces).
_sample_keys = jax.jit(jax.vmap(fold_key, (None, 0)))


@dataclasses.dataclass(eq=False)
class Response:
    """One response of a group in flight.

    Attributes:
      key: `[2]` raw key of its slot (the prompt's key folded with its sample index).
      length: tokens generated so far.
      finished: it ended (a stop token or the cap).
      records: `RECORD_FIELDS` -> `[M, ...]` its per-token records so far.
      version: `[M]` int32 the weight version each token was sampled under.
    """

    key: np.ndarray
    length: int = 0
    finished: bool = False
    records: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    version: np.ndarray | None = None


@dataclasses.dataclass(eq=False)
class Group:
    """A prompt's G responses in flight, with what the caller needs back (`payload`)."""

    prompt: np.ndarray
    payload: Any
    responses: list[Response]
    drawn: int  # the weight version when its prompt was drawn
    key: np.ndarray | None = None  # `[2]` raw key of the prompt (response g's: folded with g)

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.responses)


@dataclasses.dataclass
class Stats:
    """What one step's partial rollout did.

    Attributes:
      decode_steps: device decode steps (the scheduler's count).
      groups_in_flight: groups decoding or waiting when the round started.
      groups_drawn: new prompts drawn this step.
      carried_out: responses left unfinished for the next step (their groups not taken).
      stale_restarts: responses decoded again from their prompt, older than max_staleness.
      waiting_groups: complete groups left for a later step (more than P completed).
    """

    decode_steps: int = 0
    groups_in_flight: int = 0
    groups_drawn: int = 0
    carried_out: int = 0
    stale_restarts: int = 0
    waiting_groups: int = 0


class PartialRollout:
    """The groups in flight between RL steps (module docstring).

    Args:
      engine: the rollout engine.
      group_size: G.
      groups_per_step: P, the complete groups a step takes.
      oversample: >= 1; up to ceil(oversample x P) groups in flight.
      max_staleness: the oldest weight version a trained token may be sampled under, relative
        to the step's (0: only the current weights).
      prompt_len: the prompt columns of the batches (`RolloutBatch`).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        group_size: int,
        groups_per_step: int,
        oversample: float,
        max_staleness: int,
        prompt_len: int | None = None,
    ):
        if oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {oversample}")
        self.engine, self.g, self.p = engine, group_size, groups_per_step
        self.capacity = math.ceil(oversample * groups_per_step)
        self.max_staleness = max_staleness
        self.prompt_len = prompt_len or engine.max_prefill_length
        self.groups: list[Group] = []  # in flight, oldest first
        self.ready: list[Group] = []  # complete and accepted, waiting for a step
        self._records = None

    def in_flight_responses(self) -> int:
        """Responses of the groups in flight (dropped if the run resumes from a checkpoint)."""
        return sum(len(g.responses) for g in self.ready + self.groups)

    def _new_group(self, prompt, payload, key, version) -> Group:
        prompt, key = np.asarray(prompt, np.int32), np.asarray(key, np.uint32)
        keys = np.asarray(jax.device_get(_sample_keys(key, np.arange(self.g, dtype=np.int32))))
        return Group(prompt, payload, [self._fresh(k) for k in keys], version, key)

    def _fresh(self, key) -> Response:
        if self._records is None:  # each record's per-token shape and dtype, read once
            state = self.engine.abstract_decode_state()
            self._records = {
                f: (getattr(state, f).shape[1:], getattr(state, f).dtype) for f in RECORD_FIELDS
            }
        records = {f: np.zeros(shape, dtype) for f, (shape, dtype) in self._records.items()}
        m = self.engine.max_decode_length
        return Response(np.asarray(key), 0, False, records, np.zeros((m,), np.int32))

    def generate(
        self,
        params: nnx.State,
        version: int,
        draw: Callable[[int], Sequence[tuple[Sequence[int], Any, np.ndarray]]],
        *,
        accept: Callable[[Group], bool] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[RolloutBatch, list[Any], Stats]:
        """One step's rollout: P complete groups as a `RolloutBatch` (N = P x G rows, group
        by group in the order they completed), their payloads, and what the round did.

        Args:
          params: the rollout params (this step's weights).
          version: this step's weight version (the RL step).
          draw: n -> up to n new prompts as (token ids, payload, raw prompt key `[2]`).
          accept: a complete group -> whether to train on it (False: dropped, e.g. all its
            rewards equal, and a later group takes its place: DAPO's dynamic sampling).
          should_stop: asked between dispatches (`RolloutInterrupted`); the groups in flight
            stay as the interruption left them (a run stops there: they are not checkpointed).
        """
        stats = Stats()
        for group in self.ready + self.groups:  # a token past max_staleness: start again
            for r in group.responses:
                if r.length and version - int(r.version[: r.length].min()) > self.max_staleness:
                    r.length, r.finished = 0, False
                    stats.stale_restarts += 1
        # Groups accepted at an earlier step (more than P completed) come first.
        taken = [g for g in self.ready if g.complete]
        self.groups = [g for g in self.ready if not g.complete] + self.groups
        self.ready = []
        while len(taken) < self.p:
            want = self.capacity - len(self.groups)
            if want > 0:
                drawn = list(draw(want))
                self.groups += [self._new_group(t, pl, k, version) for t, pl, k in drawn]
                stats.groups_drawn += len(drawn)
            stats.groups_in_flight = max(stats.groups_in_flight, len(self.groups))
            for group in [g for g in self.groups if g.complete]:
                self.groups.remove(group)
                if accept is None or accept(group):
                    taken.append(group)
            if len(taken) >= self.p:
                break
            if not self.groups:
                raise RuntimeError(f"partial rollout: {len(taken)} of {self.p} groups, no prompts")
            stats.decode_steps += self._round(params, version, self.p - len(taken), should_stop)
        # Accepted groups past P wait for the next step, first in line.
        self.ready, taken = taken[self.p :], taken[: self.p]
        stats.waiting_groups = len(self.ready)
        stats.carried_out = sum(not r.finished for g in self.groups for r in g.responses)
        return self.batch_of(taken), [g.payload for g in taken], stats

    def _round(self, params, version, target, should_stop) -> int:
        """Decodes the groups in flight until `target` more of them are complete."""
        engine = self.engine
        requests = [
            (gi, si)
            for gi, g in enumerate(self.groups)
            for si, r in enumerate(g.responses)
            if not r.finished
        ]
        # Carried responses (a prefix to prefill again) ahead of new ones.
        requests.sort(key=lambda q: (self.groups[q[0]].responses[q[1]].length == 0, q))
        resp = lambda q: self.groups[q[0]].responses[q[1]]
        sched = Scheduler(
            Limits.from_engine(engine),
            [self.groups[gi].prompt.size for gi, _ in requests],
            resume=True,
            generated=[resp(q).length for q in requests],
            groups=[gi for gi, _ in requests],
            target_groups=target,
        )
        state = engine.init_decode_state()
        start = {}  # slot -> the response's length when it was placed
        sched_owner = {}  # slot -> the request index placed there
        prefixes = {}  # group -> (its prompt's prefix, row) while a fresh response waits

        def harvest(state, slots):
            """The slots' tokens since they were placed into their responses."""
            host = jax.device_get({f: getattr(state, f) for f in RECORD_FIELDS + ("step",)})
            for slot in slots:
                r = resp(requests[sched_owner[slot]])
                a, b = start.pop(slot), int(host["step"][slot])
                for f in RECORD_FIELDS:
                    r.records[f][a:b] = host[f][slot, a:b]
                r.version[a:b] = version
                r.length = b

        while not sched.done():
            if should_stop is not None and should_stop():
                raise RolloutInterrupted("rollouts abandoned: a stop was requested")
            dispatch = sched.plan()
            if dispatch.evict:
                harvest(state, dispatch.evict)
                state = engine.evict(state, dispatch.evict)
            fresh = [(s, q) for s, q in dispatch.admit if resp(requests[q]).length == 0]
            again = [(s, q) for s, q in dispatch.admit if resp(requests[q]).length > 0]
            for slot, q in dispatch.admit:
                sched_owner[slot], start[slot] = q, resp(requests[q]).length
            if fresh:  # new responses: their prompts prefilled once per group (offline's way)
                placed = [(s, requests[q]) for s, q in fresh]
                # Every group with a response still waiting is prefilled with them: one call
                # for the round's new prompts rather than one per refill.
                later = [requests[q][0] for q in sched.pending if resp(requests[q]).length == 0]
                state = self._insert_fresh(params, state, placed, prefixes, later)
                waiting = {requests[q][0] for q in sched.pending}
                for gi in [gi for gi in prefixes if gi not in waiting]:
                    del prefixes[gi]
            if again:  # carried ones: prompt + kept prefix, prefilled with these weights
                seqs = []
                for _, q in again:
                    g, r = self.groups[requests[q][0]], resp(requests[q])
                    seqs.append(np.concatenate([g.prompt, r.records["tokens"][: r.length]]))
                state = engine.resume_batch(
                    params,
                    state,
                    [s for s, _ in again],
                    seqs,
                    [resp(requests[q]).length for _, q in again],
                    keys=np.stack([resp(requests[q]).key for _, q in again]),
                )
            if dispatch.num_steps:
                state = engine.generate_steps(
                    params, state, dispatch.num_steps, dispatch.span, dispatch.stop_at_finish
                )
            step, done = jax.device_get((state.step, state.done))
            ended = sched.observe(step, done)
            if ended:
                harvest(state, [s for s, _ in ended])
                for _, q in ended:
                    resp(requests[q]).finished = True
        running = [int(s) for s in np.flatnonzero(sched.occupied)]
        if running:
            harvest(state, running)
        return sched.stats.steps

    def _insert_fresh(self, params, state, placed, prefixes, later=()):
        """(slot, (group, sample)) pairs of responses with nothing generated: each group's
        prompt prefilled once (kept in `prefixes`, group -> (prefix, row), while the round
        needs it), new ones, with the groups `later` will place (up to a slot count of rows
        in all), in one call per prompt bucket, then one insert per prefix with the sample
        indices (so response g's key is the prompt's folded with g)."""
        engine = self.engine
        now = sorted({gi for _, (gi, _) in placed} - set(prefixes))
        soon = [gi for gi in dict.fromkeys(later) if gi not in prefixes and gi not in now]
        room = max(engine.config.max_concurrent_decodes - len(now), 0)
        by_bucket = collections.defaultdict(list)
        for gi in now + soon[:room]:
            by_bucket[engine.bucket(self.groups[gi].prompt.size)].append(gi)
        for members in by_bucket.values():
            prefix = engine.prefill_batch(
                params,
                [self.groups[gi].prompt for gi in members],
                np.stack([self.groups[gi].key for gi in members]),
            )
            prefixes.update({gi: (prefix, i) for i, gi in enumerate(members)})
        inserts = {}  # id(prefix) -> (prefix, slots, rows, sample indices)
        for slot, (gi, si) in placed:
            prefix, row = prefixes[gi]
            _, slots, rows, samples = inserts.setdefault(id(prefix), (prefix, [], [], []))
            slots.append(slot)
            rows.append(row)
            samples.append(si)
        for prefix, slots, rows, samples in inserts.values():
            state = engine.insert_batch(prefix, state, slots, rows, samples)
        return state

    def batch_of(self, groups: list[Group]) -> RolloutBatch:
        """The taken groups as a fixed-shape batch (`offline.assemble`)."""
        rows = [(g.prompt, r) for g in groups for r in g.responses]
        m = self.engine.max_decode_length
        versions = np.zeros((len(rows), self.prompt_len + m), np.int32)
        for i, (prompt, r) in enumerate(rows):
            versions[i, prompt.size : prompt.size + r.length] = r.version[: r.length]
        batch = assemble(
            [prompt for prompt, _ in rows],
            [{f: r.records[f][: r.length] for f in RECORD_FIELDS} for _, r in rows],
            self.g,
            self.prompt_len + m,
            self.engine.stop_tokens,
        )
        return dataclasses.replace(batch, behaviour_version=versions)
