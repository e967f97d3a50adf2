"""When a run stops: SIGTERM / SIGINT, agreed on by every host (`Preemption`)."""

from __future__ import annotations

import signal

import jax
from absl import logging

from dvp_jax.checkpoint import Checkpointer


class Preemption:
    """Whether the run should checkpoint and stop: SIGTERM or SIGINT, agreed on by every host.

    One process: handlers set a flag that `requested()` reads at any moment, so the trainer
    stops between evaluation and rollout dispatches as well as after a step. The first SIGINT
    (Ctrl-C) is handled like SIGTERM; a second one interrupts at once (KeyboardInterrupt).
    Several processes: JAX's distributed runtime catches SIGTERM (its preemption notifier) and
    Orbax's `reached_preemption(step)` answers True on every host at the same step, so all
    hosts enter the collective save together; no Python handler is installed there (it would
    replace JAX's), and `requested()` is always False (hosts stop at step boundaries only: a
    host leaving a rollout alone would leave the others waiting in the next collective).
    """

    EXIT_CODES = {"SIGTERM": 75, "SIGINT": 130}  # EX_TEMPFAIL "try again"; 128 + SIGINT

    def __init__(self, checkpointer: Checkpointer):
        self._checkpointer = checkpointer
        self.signal_name: str | None = None
        self._polls = -1
        self._previous = {}  # the handlers ours replaced, put back by `close`
        if jax.process_count() == 1:
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass

    def close(self) -> None:
        """Puts back the handlers this object replaced (a library user's Ctrl-C works again
        once the trainer is closed)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODES.get(self.signal_name or "SIGTERM", 75)

    def _handle(self, signum, frame):
        del frame
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:  # a second Ctrl-C stops at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.signal_name is None:
            logging.warning("%s received: saving a checkpoint and stopping", name)
            self.signal_name = name

    def requested(self) -> bool:
        """Whether this process was asked to stop (one process only; see the class doc)."""
        return self.signal_name is not None

    def reached(self, step: int) -> bool:
        """Call after step `step` on every host (the same steps on all of them).

        The hosts agree through a poll counter (0, 1, 2, ... in call order, the same on every
        host), not `step` itself: warm-up steps are negative and JAX's sync manager reads an
        unset sync point as -1, so asking with step -1 would answer True with no SIGTERM.
        """
        del step
        if jax.process_count() == 1:
            return self.requested()
        self._polls += 1
        return self._checkpointer.manager.reached_preemption(self._polls)
