"""A replay of the device's decode loop (`decode.loop`) over known response lengths, driven by
the engine's own scheduler (`rollout/scheduler.py`): what the cost models count
(`rollout_cost.py`, `partial_cost.py`) and what the scheduler's tests run without a model.
"""

from __future__ import annotations

import numpy as np

from dvp_jax.rollout.scheduler import Scheduler, Stats


def simulate(scheduler: Scheduler, response_lengths, *, read_hook=None) -> Stats:
    """Runs `scheduler` to the end against a replay of the device loop (`decode.loop`) in
    which request i generates `response_lengths[i]` tokens.

    The replay keeps to the device's rules: each step every active slot generates a token; a
    slot is done after its last one; the loop ends after `num_steps` steps, when every slot is
    done, or, with `stop_at_finish`, after the step in which a slot active at its start
    finished. `read_hook(dispatch, active, pos)` is called before each step with the active
    slots and their positions (the cost model counts what the step reads).
    """
    responses = np.asarray(response_lengths, np.int64)
    lim = scheduler.limits
    b = lim.slots
    step = np.zeros((b,), np.int64)
    done = np.ones((b,), bool)
    pos = np.zeros((b,), np.int64)
    while not scheduler.done():
        dispatch = scheduler.plan()
        for s in dispatch.evict:
            done[s] = True
        for s, _ in dispatch.admit:  # a resumed response goes on from its kept tokens
            step[s], done[s], pos[s] = scheduler.step[s], False, scheduler.pos[s]
        owner = scheduler.owner.copy()
        was_done = done.copy()
        for _ in range(dispatch.num_steps):
            active = ~done
            if not active.any():
                break
            if read_hook is not None:
                read_hook(dispatch, active, pos)
            step[active] += 1
            pos[active] += 1
            target = np.where(owner >= 0, responses[np.maximum(owner, 0)], 0)
            done |= active & (step >= np.minimum(target, lim.max_decode_length))
            if dispatch.stop_at_finish and np.any(done & ~was_done):
                break
        scheduler.observe(step, done)
    return scheduler.stats
