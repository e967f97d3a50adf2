"""The tail-sum task (e007): determinism, split, response layout, the free words' law, the
vocabulary bound, reward, registration in the config."""

import math

import numpy as np
import pytest

from dvp_jax.data import rewards
from dvp_jax.data import running_sum as rs
from dvp_jax.data import tail_sum as ts
from dvp_jax.data.tail_sum import TailSumTask
from dvp_jax.tokenizers import load_tokenizer
from dvp_jax.train.sections import GENERATED_TASKS, TASK_REWARDS, DataConfig

SMALL = dict(n_words=500, tail_mass=0.2, thoughts_per_step=6)


def test_deterministic_and_splits_disjoint():
    a = TailSumTask(seed=1, **SMALL)
    assert a.train_examples(20) == TailSumTask(seed=1, **SMALL).train_examples(20)
    assert a.train_examples(20) != TailSumTask(seed=2, **SMALL).train_examples(20)
    held = a.heldout_examples(30)
    assert all(a.is_heldout(ex.key) for ex in held)
    assert not any(a.is_heldout(ex.key) for ex in a.train_examples(200))


def test_reference_response_is_a_running_sum_with_fixed_free_words():
    task = TailSumTask(**SMALL)
    words = rs.thought_words(SMALL["n_words"])
    for ex in task.train_examples(100):
        operands = [int(x) for x in ex.prompt.split()[1:-1]]
        toks = ex.target.split()
        assert len(toks) == task.max_response_len == 2 * (4 + 6) + 2
        total = 0
        for j, x in enumerate(operands):
            total += x
            step = toks[j * 10 : (j + 1) * 10]
            assert step[:4] == ["+", str(x), "=", str(total)]
            assert all(w in words for w in step[4:])
        assert toks[-2:] == [rs.ANSWER_MARKER, str(total)] and ex.answer == str(total)
        assert rewards.marked_answer_reward(ex.target, ex.answer) == 1.0


def test_free_words_follow_the_head_and_flat_tail_law():
    """2,000 examples x 12 free words: the head's share within 4 s.e. of 1 - tail_mass, and the
    tail spread over the vocabulary (no word takes more than a few draws)."""
    task = TailSumTask(**SMALL)
    free = []
    for ex in task.train_examples(2000):
        toks = ex.target.split()
        free += [w for i, w in enumerate(toks[:-2]) if i % 10 >= 4]
    head = np.mean([w == rs.thought_words(1)[0] for w in free])
    se = math.sqrt(0.2 * 0.8 / len(free))
    assert abs(head - 0.8) < 4 * se
    p = task.word_probs()
    assert p.sum() == pytest.approx(1.0) and p[0] == pytest.approx(0.8)
    tail = [w for w in free if w != rs.thought_words(1)[0]]
    assert len(set(tail)) > 0.9 * min(len(tail), SMALL["n_words"] - 1) * 0.5


def test_vocabulary_bound_puts_the_whole_tail_below_rho_p_max():
    """min_tail_words: the tail is outside e^-13 x p_max just above the bound, inside just below."""
    for m in (0.05, 0.1):
        n = ts.min_tail_words(m)
        for words, outside in ((1.01 * n, True), (0.99 * n, False)):
            assert (math.log(m / words / (1 - m)) < ts.SAFE_LOG_RHO) == outside
    assert 20_000 < ts.min_tail_words(0.05) < 26_000  # issue 46's "~25k" at p_max ~0.9-0.95
    default = TailSumTask()
    assert default.n_words - 1 > ts.min_tail_words(default.tail_mass)


@pytest.mark.parametrize(
    "knobs, match",
    [
        (dict(tail_mass=1.0), "tail_mass"),
        (dict(n_words=1), "n_words"),
        (dict(thoughts_per_step=-1), "thoughts_per_step"),
        (dict(max_operand=600), "max_operand"),
    ],
)
def test_bad_knobs_are_refused_by_name(knobs, match):
    with pytest.raises(ValueError, match=match):
        TailSumTask(**knobs)


def test_registered_as_a_generated_task_with_its_word_tokenizer():
    assert GENERATED_TASKS["tail_sum"] is TailSumTask
    assert TASK_REWARDS["tail_sum"] == "marked_answer"
    data = DataConfig(task="tail_sum", tokenizer="running_sum:500", tail_sum=SMALL)
    task = data.make_task()
    assert isinstance(task, TailSumTask) and task.n_words == 500
    tok = load_tokenizer(task.tokenizer_spec)
    ex = task.train_example(0)
    assert tok.decode(tok.encode_ids(ex.target)) == ex.target
    with pytest.raises(ValueError, match="data.tokenizer"):
        DataConfig(task="tail_sum", tokenizer="running_sum:400", tail_sum=SMALL)
