"""The tail-sum task: a running sum whose free positions have a peaked head and a flat, heavy tail.

Real LLM positions are mostly confident with a long tail over a large vocabulary, so a material
share of sampled tokens lies below e^-13 x p_max, outside the min-p safe set DVP keeps. The
running-sum task's Zipf thoughts put ~0.1% of their mass there. Here every free position draws
the head word with probability 1 - tail_mass and otherwise one of the other n_words - 1 words
uniformly, after a fixed number of free words per step (so every free position has that law):

    prompt:    sum 12 7 =
    response:  + 12 = 12 baba baba kofe baba ... + 7 = 19 baba ... <ans> 19

Why the vocabulary is this large: a tail word has probability tail_mass / (n_words - 1) and the
head 1 - tail_mass, so the whole tail lies outside the safe set only when
    tail_mass / (n_words - 1) < e^-13 (1 - tail_mass),  i.e.  n_words > tail_mass e^13 / (1 - m),
about 49k words at tail_mass 0.1 (25k for 5% of the mass at p_max 0.9), before any margin for a
learned policy that spreads its tail. `min_tail_words(tail_mass)` is that bound. The share of
sampled tokens outside the safe set is then about tail_mass x the free share of the response.

The reward ("marked_answer") reads only the integer after the last `<ans>`; the tokenizer is the
running-sum word tokenizer (`running_sum.tokenizer_spec(n_words)`: the same words, in the same
order, so word 0 is the head). Not here: the split machinery (`tasks.GeneratedTask`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dvp_jax.data import running_sum
from dvp_jax.data.running_sum import ANSWER_MARKER, MAX_N_WORDS, PROMPT_WORD
from dvp_jax.data.tasks import Example

_STEP_TOKENS = 4  # "+ x = total"
_END_TOKENS = 2  # "<ans> total"
SAFE_LOG_RHO = -13.0  # the paper's min-p threshold, which the vocabulary is sized against


def min_tail_words(tail_mass: float, log_rho: float = SAFE_LOG_RHO) -> float:
    """The number of tail words above which a uniform tail of mass `tail_mass` lies wholly below
    rho x p_max (p_max = 1 - tail_mass, the head): tail_mass / (1 - tail_mass) / rho."""
    return tail_mass / (1.0 - tail_mass) * math.exp(-log_rho)


@dataclasses.dataclass(frozen=True)
class TailSumTask(running_sum.SumProblems):
    """Generated running sums with `thoughts_per_step` free words after each step.

    Operand count uniform in [min_operands, max_operands], operands uniform in [min_operand,
    max_operand]. Each free word is the head word (word 0) with probability 1 - tail_mass, else
    uniform over words 1 .. n_words - 1. A response has n (4 + thoughts_per_step) + 2 tokens (EOS
    excluded). `Example.answer` is the total, `Example.target` the reference response,
    `Example.key` the problem ("12+7").
    """

    _SPLIT_SALT = b"dvp_jax.tail_sum.split.v1"

    seed: int = 0
    min_operands: int = 2
    max_operands: int = 2
    min_operand: int = 1
    max_operand: int = 49
    n_words: int = 100_000
    tail_mass: float = 0.1
    thoughts_per_step: int = 24
    heldout_fraction: float = 0.1

    def __post_init__(self):
        name = type(self).__name__
        self.check_problem_fields()
        if not 2 <= self.n_words <= MAX_N_WORDS:
            raise ValueError(f"{name}.n_words must be in [2, {MAX_N_WORDS}], got {self.n_words}")
        if not 0.0 <= self.tail_mass < 1.0:
            raise ValueError(f"{name}.tail_mass must be in [0, 1), got {self.tail_mass}")
        if self.thoughts_per_step < 0:
            raise ValueError(f"{name}.thoughts_per_step must be >= 0, got {self.thoughts_per_step}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(
                f"{name}.heldout_fraction must be in (0, 1), got {self.heldout_fraction}"
            )
        object.__setattr__(self, "_words", running_sum.thought_words(self.n_words))

    @property
    def max_response_len(self) -> int:
        """Longest response in tokens, EOS excluded."""
        return self.max_operands * (_STEP_TOKENS + self.thoughts_per_step) + _END_TOKENS

    def free_share(self, n_operands: int | None = None) -> float:
        """The share of a response's tokens (EOS included) that are free words."""
        n = self.max_operands if n_operands is None else n_operands
        return n * self.thoughts_per_step / (n * (_STEP_TOKENS + self.thoughts_per_step) + 3)

    def word_probs(self) -> np.ndarray:
        """[n_words] float64: the law of a free word (head word 0, then the flat tail)."""
        p = np.full(self.n_words, self.tail_mass / (self.n_words - 1))
        p[0] = 1.0 - self.tail_mass
        return p

    # -- generation ----------------------------------------------------------------------------

    def _example(self, operands: list[int], rng: np.random.Generator, index: int) -> Example:
        """Writes the reference response. Draws from `rng` only after the problem is fixed."""
        k = self.thoughts_per_step
        tail = rng.random((len(operands), k)) < self.tail_mass
        ranks = np.where(tail, rng.integers(1, self.n_words, size=tail.shape), 0)
        parts, total = [], 0
        for x, row in zip(operands, ranks.tolist(), strict=True):
            total += x
            parts += ["+", str(x), "=", str(total), *(self._words[r] for r in row)]
        parts += [ANSWER_MARKER, str(total)]
        return Example(
            prompt=" ".join([PROMPT_WORD, *map(str, operands), "="]),
            answer=str(total),
            key=self._problem_key(operands),
            index=index,
            target=" ".join(parts),
        )
