"""The one rollout scheduler: admission, page budgets, preemption, dispatch sizing.

Every caller that decodes requests through the engine's slots asks this module what to do next
and tells it what happened: the RL loop (`offline.generate_rollouts`) and partial rollouts
(`partial.py`) run it against the device, the server's JetStream adapter
(`serve/jetstream.JetStreamEngine`) one step at a time, and the cost models
(`plan/rollout_cost.py`, `plan/partial_cost.py`) against `plan/replay.simulate`, a replay of the
device loop over known response lengths. The decisions live here only, so the cost model's
decode steps are the engine's by construction.

A round is `plan()` -> a `Dispatch` (evict these slots, insert these requests, then run up to
`num_steps` decode steps over `span`) and `observe()` of the slots' step counts and done flags
afterwards. The rules (docs/design.md section 3, "The scheduler"):

* Pages are counted on the host: a slot at position `pos` holds ceil(pos / ps) pages, and k
  more steps take it to ceil((pos + k') / ps), k' = min(k, the tokens it may still generate).
  A dispatch never asks the device for more pages than the pool has, so the device never runs
  short (its own preemption stays as a guard and is counted if it ever fires).
* Progress: responses are ranked by admission (oldest first). When the active slots cannot all
  take one more step, the youngest are evicted (their pages freed, their requests back at the
  front of the queue, decoded again from the start with the same keys) until they can; the
  oldest is never evicted, and the pool holds one slot at full length, so the oldest always
  advances and every response finishes.
* Admission: queued requests take free slots in order while the pool holds their prompt and
  their first `min_steps` steps beside the active slots' next `min_steps` (so a response just
  evicted is not readmitted into the same shortage).
* Sizing: a dispatch runs at least `min_steps` steps (or all the slots need), and, unless
  `steps_per_sync` fixes it, as many more as keep its read span (the dense length bucket or the
  ragged path's page bucket; the kernel has none) and its pages within budget, up to
  `max_steps`. It ends on the device after the step in which a slot finishes while requests
  wait (`stop_at_finish`), so a freed slot is refilled at once whatever its size.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

# Decode steps a dispatch runs at least (when the slots need that many) between host checks.
MIN_STEPS = 8
# Decode steps a dispatch runs at most: the host checks `should_stop` at least this often.
MAX_STEPS = 512
SPAN_KINDS = ("positions", "pages", "own")


@dataclasses.dataclass(frozen=True)
class Span:
    """What a decode dispatch's attention reads, as the static argument of its program.

    Attributes:
      kind: "positions" (dense cache: the first `size` positions of every slot, a
        `kv_buckets` value), "pages" (ragged XLA path: a flat list of `size` live pages, a
        `page_buckets` value) or "own" (the paged kernel: each slot's own pages, size 0).
      size: the bound.
    """

    kind: str
    size: int

    def __post_init__(self):
        if self.kind not in SPAN_KINDS:
            raise ValueError(f"Span.kind must be one of {SPAN_KINDS}, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The engine's static sizes the scheduler decides within (`from_engine`).

    Attributes:
      slots: B, decode slots.
      max_decode_length: M, most tokens per response.
      cache_length: S, positions per slot.
      page_size: positions per page (paged cache), else 0.
      num_pages: pages in the pool (paged cache), else 0.
      buckets: the span's buckets (`kv_buckets` dense, `page_buckets` ragged; () kernel).
      span_kind: one of `SPAN_KINDS`.
      steps_per_sync: a fixed dispatch size (every dispatch runs up to this many steps), or
        None to size each dispatch (module docstring).
      min_steps, max_steps: the sized dispatch's bounds.
    """

    slots: int
    max_decode_length: int
    cache_length: int
    page_size: int = 0
    num_pages: int = 0
    buckets: tuple[int, ...] = ()
    span_kind: str = "positions"
    steps_per_sync: int | None = None
    min_steps: int = MIN_STEPS
    max_steps: int = MAX_STEPS

    def __post_init__(self):
        if self.steps_per_sync is not None and self.steps_per_sync < 1:
            raise ValueError(f"steps_per_sync must be None or >= 1, got {self.steps_per_sync}")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(
                f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}"
            )

    @classmethod
    def of(cls, config, impl: str | None, steps_per_sync: int | None = None, **kw) -> Limits:
        """The limits of an engine of `config` (`EngineConfig`) whose paged path is `impl`
        ("kernel" or "xla"; None on a dense cache)."""
        if not config.paged:
            kind, buckets, ps, pages = "positions", config.kv_buckets, 0, 0
        else:
            kind = "own" if impl == "kernel" else "pages"
            buckets = () if impl == "kernel" else config.page_buckets
            ps, pages = config.page_size, config.num_pages
        return cls(
            slots=config.max_concurrent_decodes,
            max_decode_length=config.max_decode_length,
            cache_length=config.cache_length,
            page_size=ps,
            num_pages=pages,
            buckets=tuple(buckets),
            span_kind=kind,
            steps_per_sync=steps_per_sync,
            **kw,
        )

    @classmethod
    def from_engine(cls, engine, steps_per_sync: int | None = None, **kw) -> Limits:
        """The limits of a `RolloutEngine`."""
        return cls.of(engine.config, engine.paged_impl, steps_per_sync, **kw)

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    def pages(self, positions) -> np.ndarray:
        """Pages that hold `positions` positions (0 on a dense cache)."""
        if not self.paged:
            return np.zeros(np.shape(positions), np.int64)
        return -(-np.asarray(positions, np.int64) // self.page_size)

    def bucket(self, need: int) -> int:
        """The smallest bucket >= need (the largest if none)."""
        b = self.buckets
        return b[min(bisect.bisect_left(b, int(need)), len(b) - 1)]


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """One round of the decode: evictions, insertions, then up to `num_steps` steps.

    Attributes:
      evict: slots to stop and free (their requests are queued again).
      admit: (slot, request) pairs to insert, in queue order.
      num_steps: at most this many decode steps (0: nothing to decode this round).
      span: the steps' read bound.
      stop_at_finish: end after the step in which a slot finishes (requests wait, or a
        partial round counts its complete groups).
      live_pages: the pages the active slots hold together by the end of the steps (paged).
    """

    evict: tuple[int, ...]
    admit: tuple[tuple[int, int], ...]
    num_steps: int
    span: Span
    stop_at_finish: bool
    live_pages: int = 0


@dataclasses.dataclass
class Stats:
    """What a schedule did: decode steps (device loop iterations), dispatches, admissions,
    evictions (host preemptions) and device preemptions (the guard; 0 when the host's page
    count is right)."""

    steps: int = 0
    dispatches: int = 0
    admissions: int = 0
    evictions: int = 0
    device_preemptions: int = 0


class Scheduler:
    """Decides, round by round, what the engine's slots do (module docstring).

    Args:
      limits: the engine's sizes.
      prompt_lengths: `[n]` prompt length of each request known at the start (request i is
        index i); `add` queues more.
      order: the queue's initial order of those request indices (default 0..n-1).
      resume: what an evicted response keeps. False (the RL loop): nothing, it is decoded again
        from its prompt with the same keys, and it counts as admitted anew (younger than every
        response then running). True (the server): its tokens, prefilled again with the
        prompt when it is readmitted (`RolloutEngine.resume_batch`), and its rank by arrival.
    """

    def __init__(
        self,
        limits: Limits,
        prompt_lengths: Sequence[int] = (),
        order=None,
        resume=False,
        *,
        generated: Sequence[int] | None = None,
        groups: Sequence[int] | None = None,
        target_groups: int | None = None,
    ):
        self.limits, self.resume = limits, resume
        self.prompt_lengths = [int(x) for x in prompt_lengths]
        n = len(self.prompt_lengths)
        # Tokens a request keeps while it waits (resume mode; a carried response's so far).
        self.generated = [0] * n if generated is None else [int(x) for x in generated]
        self.home = [-1] * n  # the slot a request must use (-1: any)
        # Partial rollouts: request -> group; the round ends once `target_groups` groups have
        # every response finished (`complete`, in the order they completed).
        self.group = None if groups is None else [int(x) for x in groups]
        self.target_groups = target_groups
        self.complete: list[int] = []
        self.finished: set[int] = set()
        if self.group is not None:
            self._left = collections.Counter(self.group)
        self.pending = collections.deque(range(n) if order is None else order)
        b = limits.slots
        self.owner = np.full((b,), -1, np.int64)  # request in each slot, -1 free
        self.age = np.zeros((b,), np.int64)  # admission rank of each slot's request
        self.pos = np.zeros((b,), np.int64)  # positions in the slot's sequence so far
        self.step = np.zeros((b,), np.int64)  # tokens generated so far
        self.stats = Stats()
        self._admitted = 0
        self._started = np.zeros((b,), np.int64)  # step count at the last plan

    def add(self, prompt_length: int, home: int = -1) -> int:
        """Queues a request (at the back); returns its index. `home`: the slot it must use."""
        self.prompt_lengths.append(int(prompt_length))
        self.generated.append(0)
        self.home.append(int(home))
        self.pending.append(len(self.prompt_lengths) - 1)
        return len(self.prompt_lengths) - 1

    def cancel(self, request: int) -> int:
        """Forgets a request, waiting or running; returns the slot it ran in (the caller stops
        it on the device), or -1."""
        if request in self.pending:
            self.pending.remove(request)
        slots = np.flatnonzero(self.owner == request)
        for s in slots:
            self.owner[s] = -1
        return int(slots[0]) if slots.size else -1

    # ------------------------------------------------------------------------------------------
    @property
    def occupied(self) -> np.ndarray:
        return self.owner >= 0

    def done(self) -> bool:
        """True once every request has finished, or `target_groups` groups have."""
        if self.target_groups is not None and len(self.complete) >= self.target_groups:
            return True
        return not self.pending and not self.occupied.any()

    def unfinished(self) -> list[tuple[int, int]]:
        """(request, tokens it has generated) of every request not finished: what a partial
        round carries over (running ones at their step, queued ones at what they kept)."""
        out = [(int(r), int(self.step[s])) for s, r in enumerate(self.owner) if r >= 0]
        out += [(r, self.generated[r]) for r in self.pending]
        return sorted(out)

    def _need(self, slots: np.ndarray, k: int) -> int:
        """Pages `slots` hold after k more steps each (each capped at what it may generate)."""
        lim = self.limits
        steps = np.minimum(k, lim.max_decode_length - self.step[slots])
        return int(np.sum(lim.pages(self.pos[slots] + steps)))

    def _need_new(self, requests: Sequence[int], k: int) -> int:
        """Pages queued `requests` hold once admitted and k steps on."""
        lim = self.limits
        done = np.asarray([self.generated[r] for r in requests], np.int64)
        prompts = np.asarray([self.prompt_lengths[r] for r in requests], np.int64)
        steps = np.minimum(k, lim.max_decode_length - done)
        return int(np.sum(lim.pages(prompts + done + steps)))

    def _evict(self, slot: int) -> None:
        request = int(self.owner[slot])
        if self.resume:
            self.generated[request] = int(self.step[slot])
        self.pending.appendleft(request)
        self.owner[slot] = -1
        self.stats.evictions += 1

    def _slot_for(self, request: int, free: list[int]) -> int | None:
        """The free slot `request` takes: its home, or the first free one no waiting request
        calls home."""
        if self.home[request] >= 0:
            return self.home[request] if self.home[request] in free else None
        homes = {self.home[r] for r in self.pending}
        return next((s for s in free if s not in homes), None)

    def plan(self) -> Dispatch:
        """The next round (call `observe` after running it)."""
        lim = self.limits
        evicted = []
        if lim.paged:
            # Progress: the active slots must all take one more step; the youngest yield.
            while True:
                active = np.flatnonzero(self.occupied)
                if self._need(active, 1) <= lim.num_pages:
                    break
                youngest = active[np.argmax(self.age[active])]
                self._evict(youngest)
                evicted.append(int(youngest))
        k_min = lim.steps_per_sync or lim.min_steps
        # Admission looks `min_steps` ahead even when dispatches are shorter, so a response
        # just evicted is not readmitted into the same shortage at once.
        horizon = max(k_min, lim.min_steps)
        admit = []
        free = [int(s) for s in np.flatnonzero(~self.occupied)]
        active = np.flatnonzero(self.occupied)
        while free and self.pending:
            request = self.pending[0]
            if lim.paged and active.size + len(admit) > 0:
                held = self._need(active, horizon)
                held += self._need_new([r for _, r in admit] + [request], horizon)
                if held > lim.num_pages:
                    break
            slot = self._slot_for(request, free)
            if slot is None:
                break
            self.pending.popleft()
            free.remove(slot)
            admit.append((slot, request))
            self.owner[slot] = request
            self.age[slot] = request if self.resume else self._admitted
            self._admitted += 1
            self.step[slot] = self.generated[request]
            self.pos[slot] = self.prompt_lengths[request] + self.step[slot]
        self.stats.admissions += len(admit)
        active = np.flatnonzero(self.occupied)
        self._started = self.step.copy()
        if active.size == 0:
            return Dispatch(tuple(evicted), tuple(admit), 0, self._span(0), False)
        left = int(np.max(lim.max_decode_length - self.step[active]))
        k = self._size(active, min(k_min, left), left)
        return Dispatch(
            tuple(evicted),
            tuple(admit),
            k,
            self._span(self._read(active, k)),
            bool(self.pending) or self.target_groups is not None,
            self._need(active, k) if lim.paged else 0,
        )

    def _read(self, active: np.ndarray, k: int) -> int:
        """What k steps read: the dense path's highest position + 1 over all slots, the ragged
        path's live pages (every slot's, capped at what it may still generate)."""
        lim = self.limits
        if lim.span_kind == "positions":
            return int(np.max(self.pos[active])) + k
        if lim.span_kind == "pages":
            return self._need(active, k)
        return 0

    def _span(self, read: int) -> Span:
        lim = self.limits
        if lim.span_kind == "own":
            return Span("own", 0)
        return Span(lim.span_kind, lim.bucket(max(read, 1)))

    def _size(self, active: np.ndarray, k_min: int, left: int) -> int:
        """The dispatch's steps: at least k_min (fewer only if the pool holds fewer), more
        while the span and the pool allow (sized dispatches only)."""
        lim = self.limits
        fits = lambda k: not lim.paged or self._need(active, k) <= lim.num_pages
        k = max(1, k_min)
        while k > 1 and not fits(k):
            k -= 1
        if lim.steps_per_sync is not None:
            return k
        span = self._span(self._read(active, k))
        hi = min(left, lim.max_steps)
        # The largest k' in [k, hi] with the same span and pages within the pool (both grow
        # with k', so a binary search finds the edge).
        ok = lambda j: fits(j) and self._span(self._read(active, j)) == span
        lo = k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def observe(self, step, done, preempted=None) -> list[tuple[int, int]]:
        """Records a dispatch's outcome; returns the (slot, request) pairs that finished.

        Args:
          step: `[B]` tokens each slot has generated (the device's `step`).
          done: `[B]` bool, the device's `done`.
          preempted: `[B]` bool, slots the device stopped for want of a page (the guard), or
            None: their requests are queued again and counted.
        """
        step, done = np.asarray(step, np.int64), np.asarray(done, bool)
        active = self.occupied
        if active.any():
            self.stats.steps += int(np.max(step[active] - self._started[active]))
            self.stats.dispatches += 1
        self.pos[active] += step[active] - self.step[active]
        self.step[active] = step[active]
        if preempted is not None:
            for s in np.flatnonzero(np.asarray(preempted, bool) & active)[::-1]:
                self.pending.appendleft(int(self.owner[s]))
                self.owner[s] = -1
                self.stats.device_preemptions += 1
        ended = [(int(s), int(self.owner[s])) for s in np.flatnonzero(self.occupied & done)]
        for s, r in ended:
            self.owner[s] = -1
            self.home[r] = -1
            self.finished.add(r)
            if self.group is not None:
                self._left[self.group[r]] -= 1
                if self._left[self.group[r]] == 0:
                    self.complete.append(self.group[r])
        return ended
