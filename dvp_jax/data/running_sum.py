"""The running-sum task: long, high-entropy responses with an exactly verifiable answer.

A problem is a list of operands; the reference response walks the running sum, "thinks" a random
number of free words drawn from a Zipf law after every step, then states the total:

    prompt:    sum 12 7 33 =
    response:  + 12 = 12 kobe babe ... + 7 = 19 ludi ... + 33 = 52 baba pefo ... <ans> 52

The reward ("marked_answer", `rewards`) reads only the integer after the last `<ans>`, so the
thought words are free. Text is single-space separated whole words, what the word-level
tokenizer `load_tokenizer("running_sum:<n_words>")` (`dvp_jax.tokenizers`) splits on;
`vocabulary(n_words)` is its token list. Not here: the split machinery (`tasks.GeneratedTask`).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from dvp_jax.data.tasks import Example, GeneratedTask, in_hash_fraction

PROMPT_WORD = "sum"
ANSWER_MARKER = "<ans>"
MAX_NUMBER = 999  # Numbers are whole-word tokens "0".."999"; totals must stay within them.
STRUCTURE_TOKENS = (PROMPT_WORD, "=", "+", ANSWER_MARKER)
DEFAULT_N_WORDS = 2000
MAX_N_WORDS = 70**2 + 70**3  # every two- and three-syllable word (347,900; e007 uses 300k)
TOKENIZER_NAME = "running_sum"

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)  # 70 syllables.
_STEP_TOKENS = 4  # "+ x = total"
_END_TOKENS = 2  # "<ans> total"


def thought_words(n: int) -> tuple[str, ...]:
    """The first `n` thought words, by Zipf rank: two consonant-vowel syllables ("baba",
    "babe", ...; 4,900 of them), then three. Lowercase letters only, so a thought word is never a
    number, a marker or the prompt word."""
    if not 0 <= n <= MAX_N_WORDS:
        raise ValueError(f"thought_words: need 0 <= n <= {MAX_N_WORDS}, got {n}")
    words = []
    for length in (2, 3):
        for parts in itertools.product(_SYLLABLES, repeat=length):
            if len(words) == n:
                return tuple(words)
            words.append("".join(parts))
    return tuple(words)


def vocabulary(n_words: int) -> tuple[str, ...]:
    """The task's non-special tokens in id order: `STRUCTURE_TOKENS`, the numbers "0" ..
    `MAX_NUMBER`, then `thought_words(n_words)`."""
    numbers = tuple(str(x) for x in range(MAX_NUMBER + 1))
    return STRUCTURE_TOKENS + numbers + thought_words(n_words)


def tokenizer_spec(n_words: int) -> str:
    """The `load_tokenizer` spec of the vocabulary with `n_words` thought words."""
    return f"{TOKENIZER_NAME}:{n_words}"


def zipf_probs(n: int, exponent: float) -> np.ndarray:
    """[n] float64 probabilities p(rank k) = k^-exponent / sum_j j^-exponent, k = 1..n."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -float(exponent)
    return p / p.sum()


def zipf_entropy(n: int, exponent: float) -> float:
    """Entropy in nats of `zipf_probs(n, exponent)`."""
    p = zipf_probs(n, exponent)
    return float(-(p * np.log(p)).sum())


class SumProblems(GeneratedTask):
    """What the running-sum tasks share (`RunningSumTask`, `tail_sum.TailSumTask`): their sum
    problems (the operand fields, drawn, keyed "12+7+33" and split by a hash under the subclass's
    `_SPLIT_SALT`), their prompt ("sum", the operands, "=") and their vocabulary (`n_words`
    thought words). A subclass is a frozen dataclass with the fields `seed`, `min_operands`,
    `max_operands`, `min_operand`, `max_operand`, `n_words` and `heldout_fraction`, and writes
    the response (`_example`)."""

    _TRAIN_HINT = _HELDOUT_HINT = "widen the operands"
    _SPLIT_SALT: bytes

    def check_problem_fields(self) -> None:
        """The one check of the sum problems' fields: seed, operand counts and sizes within the
        number tokens."""
        name = type(self).__name__
        if self.seed < 0:
            raise ValueError(f"{name}.seed must be >= 0, got {self.seed}")
        if not 1 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"{name}: need 1 <= min_operands <= max_operands, got min_operands="
                f"{self.min_operands}, max_operands={self.max_operands}"
            )
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"{name}: need 0 <= min_operand <= max_operand, got min_operand="
                f"{self.min_operand}, max_operand={self.max_operand}"
            )
        if self.max_operands * self.max_operand > MAX_NUMBER:
            raise ValueError(
                f"{name}: max_operands * max_operand = {self.max_operands * self.max_operand} "
                f"exceeds the largest number token {MAX_NUMBER}; lower max_operand or "
                "max_operands"
            )

    @property
    def tokenizer_spec(self) -> str:
        """The `load_tokenizer` spec whose vocabulary holds every token of this task."""
        return tokenizer_spec(self.n_words)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt in tokens, BOS excluded: "sum", the operands, "="."""
        return self.max_operands + 2

    def is_heldout(self, key: str) -> bool:
        """Whether the problem with canonical key `key` (e.g. "12+7+33") is held out."""
        return in_hash_fraction(key, self._SPLIT_SALT, self.heldout_fraction)

    def _draw(self, rng: np.random.Generator) -> list[int]:
        n = int(rng.integers(self.min_operands, self.max_operands + 1))
        return [int(x) for x in rng.integers(self.min_operand, self.max_operand + 1, size=n)]

    @staticmethod
    def _problem_key(operands: list[int]) -> str:
        return "+".join(str(x) for x in operands)


@dataclasses.dataclass(frozen=True)
class RunningSumTask(SumProblems):
    """Generated running-sum problems with free Zipf "thoughts".

    Per problem: the operand count uniform in [min_operands, max_operands], operands uniform in
    [min_operand, max_operand]; the response length R (tokens, EOS excluded) uniform in
    [min_response_len, max_response_len], exactly, whatever the operand count; the R - (4n + 2)
    thought words split over the n steps by a uniformly random composition, each word drawn
    i.i.d. from p(rank k) ~ k^-zipf_exponent over `n_words` words. `Example.answer` is the
    total, `Example.target` the reference response, `Example.key` the problem ("12+7+33").
    """

    _SPLIT_SALT = b"dvp_jax.running_sum.split.v1"

    seed: int = 0
    min_operands: int = 4
    max_operands: int = 8
    min_operand: int = 1
    max_operand: int = 99
    n_words: int = DEFAULT_N_WORDS
    zipf_exponent: float = 1.1
    min_response_len: int = 150
    max_response_len: int = 250
    heldout_fraction: float = 0.1

    def __post_init__(self):
        name = type(self).__name__
        self.check_problem_fields()
        if not 1 <= self.n_words <= MAX_N_WORDS:
            raise ValueError(f"{name}.n_words must be in [1, {MAX_N_WORDS}], got {self.n_words}")
        if not (np.isfinite(self.zipf_exponent) and self.zipf_exponent >= 0):
            raise ValueError(
                f"{name}.zipf_exponent must be a finite float >= 0, got {self.zipf_exponent}"
            )
        least = self.max_operands * _STEP_TOKENS + _END_TOKENS
        if not least <= self.min_response_len <= self.max_response_len:
            raise ValueError(
                f"{name}: need {least} <= min_response_len <= max_response_len (the longest "
                f"problem's steps and answer, 4 * max_operands + 2, take {least} tokens), got "
                f"min_response_len={self.min_response_len}, "
                f"max_response_len={self.max_response_len}"
            )
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(
                f"{name}.heldout_fraction must be in (0, 1), got {self.heldout_fraction}"
            )
        cdf = np.cumsum(zipf_probs(self.n_words, self.zipf_exponent))
        object.__setattr__(self, "_cdf", cdf)  # Not a field: derived, excluded from eq/repr.
        object.__setattr__(self, "_words", thought_words(self.n_words))

    # -- generation ----------------------------------------------------------------------------

    def _example(self, operands: list[int], rng: np.random.Generator, index: int) -> Example:
        """Writes the reference response. Draws from `rng` only after the problem is fixed."""
        n = len(operands)
        length = int(rng.integers(self.min_response_len, self.max_response_len + 1))
        n_thought = length - n * _STEP_TOKENS - _END_TOKENS
        # A uniformly random composition of n_thought into n parts >= 0 (stars and bars).
        cuts = np.sort(rng.choice(n_thought + n - 1, size=n - 1, replace=False))
        bounds = np.concatenate([[-1], cuts, [n_thought + n - 1]])
        per_step = (np.diff(bounds) - 1).tolist()
        ranks = np.searchsorted(self._cdf, rng.random(n_thought), side="right")
        ranks = np.minimum(ranks, self.n_words - 1)  # Guards a cdf[-1] rounded below 1.
        words = [self._words[r] for r in ranks.tolist()]
        parts, total, used = [], 0, 0
        for x, k in zip(operands, per_step, strict=True):
            total += x
            parts += ["+", str(x), "=", str(total), *words[used : used + k]]
            used += k
        parts += [ANSWER_MARKER, str(total)]
        prompt = " ".join([PROMPT_WORD, *map(str, operands), "="])
        return Example(
            prompt=prompt,
            answer=str(total),
            key=self._problem_key(operands),
            index=index,
            target=" ".join(parts),
        )
