"""Generated tasks: `Example`, the `GeneratedTask` base (train / held-out splits) and arithmetic.

A generated task needs no download: problem `i` of stream `s` of its train split is a pure
function of (seed, s, i), and its held-out split is decided by a salted hash of each problem's
canonical key alone (not the seed, the wording or the stream), so the splits never overlap.
`ArithmeticTask` is the embedded default; `running_sum.RunningSumTask` is the long-response
task. A task owns its knobs: their defaults and checks live in its dataclass, and
`config.data.<task>` passes them through under the same names. Not here: math files
(`math_data`), verifiers (`rewards`), batching (`pipeline`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------------------------
# Examples
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Example:
    """A prompt and its ground truth. `key` identifies the problem, `index` its source row;
    `target` is the full reference response for supervised warm-up ("" when it is `answer`)."""

    prompt: str
    answer: str
    key: str = ""
    index: int = -1
    target: str = ""


# Generated tasks: stream ids, draw limits.
_HELDOUT_STREAM = 2**31 - 1  # A stream id train draws never use (checked in train_example).
_MAX_TRIES = 10_000
_MAX_HELDOUT_MISSES = 50_000  # Consecutive draws without a new held-out problem.


class GeneratedTask:
    """Base class of the generated tasks (`ArithmeticTask`, `running_sum.RunningSumTask`).

    `train_example(i, stream=0)`: train problem `i` of `stream` (the pipeline draws RL prompts
    from stream 0, warm-up examples from stream 1); `train_examples(n, start, stream)`;
    `heldout_examples(n)`: `n` distinct held-out problems, a pure function of (seed, n), raising
    when the split has fewer; `is_heldout(key)`. Train draws reject held-out problems.

    A generated task has an endless train split addressed by (stream, index) and a held-out split
    defined by a hash of each problem's canonical key; `isinstance(x, GeneratedTask)` is how the
    pipeline, the warm-up and the evaluation recognise one. Both splits are drawn here from a
    subclass's `seed` and its hooks: `is_heldout(key)`, `_draw(rng)` (a problem, or None for a
    rejected draw), `_problem_key(problem)` (its canonical key) and `_example(problem, rng,
    index)` (words it, drawing from `rng` only after the problem is fixed). `_TRAIN_HINT` and
    `_HELDOUT_HINT` say how to widen the task when a split runs dry.
    """

    seed: int
    _TRAIN_HINT = "widen the task"
    _HELDOUT_HINT = "widen the task"

    def is_heldout(self, key: str) -> bool:
        """Whether the problem with canonical key `key` is in the held-out split."""
        raise NotImplementedError

    def _draw(self, rng: np.random.Generator) -> Any:
        raise NotImplementedError

    def _problem_key(self, problem) -> str:
        raise NotImplementedError

    def _example(self, problem, rng: np.random.Generator, index: int) -> Example:
        raise NotImplementedError

    def _rng(self, stream: int, i: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream, i])

    def train_example(self, i: int, stream: int = 0) -> Example:
        """Train problem number `i` (>= 0) of `stream`; a pure function of (seed, stream, i)."""
        i, stream = int(i), int(stream)
        if i < 0 or not 0 <= stream < _HELDOUT_STREAM:
            raise ValueError(f"need i >= 0 and 0 <= stream < {_HELDOUT_STREAM}, got {i}, {stream}")
        rng = self._rng(stream, i)
        for _ in range(_MAX_TRIES):
            problem = self._draw(rng)
            if problem is not None and not self.is_heldout(self._problem_key(problem)):
                return self._example(problem, rng, i)
        raise ValueError(
            f"{self}: no train problem found in {_MAX_TRIES} draws; lower heldout_fraction or "
            + self._TRAIN_HINT
        )

    def train_examples(self, n: int, start: int = 0, stream: int = 0) -> list[Example]:
        """Train problems `start` .. `start + n - 1` of `stream`."""
        return [self.train_example(i, stream) for i in range(start, start + n)]

    def heldout_examples(self, n: int) -> list[Example]:
        """`n` distinct held-out problems, a pure function of (seed, n), in a fixed order."""
        rng = self._rng(_HELDOUT_STREAM, 0)
        seen: dict[str, Example] = {}
        misses = 0
        while len(seen) < n:
            problem = self._draw(rng)
            key = None if problem is None else self._problem_key(problem)
            if key is not None and key not in seen and self.is_heldout(key):
                seen[key] = self._example(problem, rng, len(seen))
                misses = 0
            else:
                misses += 1
                if misses > _MAX_HELDOUT_MISSES:
                    raise ValueError(
                        f"{self}: found only {len(seen)} distinct held-out problems, {n} "
                        f"requested; {self._HELDOUT_HINT} or raise heldout_fraction"
                    )
        return list(seen.values())


def in_hash_fraction(key: str, salt: bytes, fraction: float) -> bool:
    """The held-out rule of the generated tasks: whether the salted 64-bit BLAKE2b hash of `key`
    falls in the first `fraction` of the hash range."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


# ----------------------------------------------------------------------------------------------
# Arithmetic task
# ----------------------------------------------------------------------------------------------

_OPS = ("+", "-", "*")
_OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}
_WORD_TEMPLATES = ("what is {}? ", "{} is ", "{} equals ")
_STYLES = ("symbolic", "words", "mixed")
_SPLIT_SALT = b"dvp_jax.arithmetic.split.v1"


def _evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ..., `*` before `+`/`-`, left to right."""
    terms, signs, cur = [], ["+"], operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            cur *= x
        else:
            terms.append(cur)
            signs.append(op)
            cur = x
    terms.append(cur)
    return sum(t if s == "+" else -t for s, t in zip(signs, terms, strict=True))


@dataclasses.dataclass(frozen=True)
class ArithmeticTask(GeneratedTask):
    """Generated arithmetic problems with an integer answer.

    The operand count is uniform in [min_operands, num_operands] (min_operands None: exactly
    num_operands), operands uniform in [min_operand, max_operand], ops drawn from `ops` (`+ - *`,
    usual precedence); a negative answer is redrawn unless `allow_negative`. Wording: `style`
    "symbolic" ("12+34="), "words" ("what is 12 plus 34? ", "12 plus 34 is ", "12 plus 34
    equals ") or "mixed" (either, per problem). The canonical key is the symbolic expression
    ("12+34"); `Example.answer` is the integer, and the engine appends EOS to responses, so a
    perfect response is exactly the answer.
    """

    _TRAIN_HINT = "allow negative answers"
    _HELDOUT_HINT = "widen the task (operands, ops)"

    seed: int = 0
    num_operands: int = 2
    min_operands: int | None = None
    min_operand: int = 0
    max_operand: int = 49
    ops: tuple[str, ...] = ("+", "-")
    allow_negative: bool = False
    style: str = "symbolic"
    heldout_fraction: float = 0.1

    def __post_init__(self):
        object.__setattr__(self, "ops", tuple(self.ops))
        lo = self.num_operands if self.min_operands is None else self.min_operands
        if not 2 <= lo <= self.num_operands:
            raise ValueError(
                f"ArithmeticTask: need 2 <= min_operands <= num_operands, got min_operands={lo}, "
                f"num_operands={self.num_operands}"
            )
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                "ArithmeticTask: need 0 <= min_operand <= max_operand, got "
                f"min_operand={self.min_operand}, max_operand={self.max_operand}"
            )
        if not self.ops or any(op not in _OPS for op in self.ops):
            raise ValueError(
                f"ArithmeticTask.ops must be a non-empty subset of {_OPS}, got {self.ops}"
            )
        if self.style not in _STYLES:
            raise ValueError(f"ArithmeticTask.style must be one of {_STYLES}, got {self.style!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(
                f"ArithmeticTask.heldout_fraction must be in (0, 1), got {self.heldout_fraction}"
            )
        if self.seed < 0:
            raise ValueError(f"ArithmeticTask.seed must be >= 0, got {self.seed}")

    # -- split ---------------------------------------------------------------------------------

    def is_heldout(self, key: str) -> bool:
        """Whether the problem with canonical key `key` (e.g. "12+34") is in the held-out split."""
        return in_hash_fraction(key, _SPLIT_SALT, self.heldout_fraction)

    # -- generation ----------------------------------------------------------------------------

    def _draw(self, rng: np.random.Generator) -> tuple[list[int], list[str], int] | None:
        """One problem (operands, ops, answer), or None when the answer is not allowed."""
        lo = self.num_operands if self.min_operands is None else self.min_operands
        n = int(rng.integers(lo, self.num_operands + 1))
        operands = [int(x) for x in rng.integers(self.min_operand, self.max_operand + 1, size=n)]
        ops = [self.ops[int(j)] for j in rng.integers(0, len(self.ops), size=n - 1)]
        answer = _evaluate(operands, ops)
        if answer < 0 and not self.allow_negative:
            return None
        return operands, ops, answer

    @staticmethod
    def _key(operands: list[int], ops: list[str]) -> str:
        return str(operands[0]) + "".join(
            f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True)
        )

    def _example(self, problem, rng: np.random.Generator, index: int) -> Example:
        """Words the problem. Draws from `rng` only after the problem is fixed, so the problem
        sequence is the same for every style."""
        operands, ops, answer = problem
        key = self._key(operands, ops)
        words = self.style == "words" or (self.style == "mixed" and rng.random() < 0.5)
        if words:
            spoken = f"{operands[0]}" + "".join(
                f" {_OP_WORDS[op]} {x}" for op, x in zip(ops, operands[1:], strict=True)
            )
            prompt = _WORD_TEMPLATES[int(rng.integers(len(_WORD_TEMPLATES)))].format(spoken)
        else:
            prompt = key + "="
        return Example(prompt=prompt, answer=str(answer), key=key, index=index)

    def _problem_key(self, problem) -> str:
        return self._key(*problem[:2])
