"""The generated arithmetic task: determinism, the train/held-out split, knobs, validation."""

import dataclasses

import pytest

from dvp_jax.data.tasks import ArithmeticTask, _evaluate
from dvp_jax.tokenizers import CharTokenizer


def test_deterministic_from_seed():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert a.train_examples(50) == b.train_examples(50)
    assert a.heldout_examples(40) == b.heldout_examples(40)
    assert a.train_example(17) == a.train_examples(1, start=17)[0]  # Random access.
    assert a.train_examples(50) != ArithmeticTask(seed=4).train_examples(50)
    assert a.train_examples(50) != a.train_examples(50, stream=1)


def test_answers_are_correct_and_prompts_short():
    task = ArithmeticTask(ops=("+", "-", "*"), num_operands=3, min_operands=2)
    for ex in task.train_examples(300) + task.heldout_examples(100):
        assert ex.prompt == ex.key + "="
        assert int(ex.answer) == eval(ex.key)  # noqa: S307 - digits and + - * only.
        assert int(ex.answer) >= 0
    default = ArithmeticTask()
    for ex in default.train_examples(500):
        assert len(ex.prompt) <= 6 and 1 <= len(ex.answer) <= 2
        CharTokenizer().encode_ids(ex.prompt + ex.answer)  # Every character is in the vocabulary.


def test_evaluate_precedence():
    assert _evaluate([2, 3, 4], ["+", "*"]) == 14
    assert _evaluate([10, 2, 3], ["-", "-"]) == 5
    assert _evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14


@pytest.mark.parametrize("seeds", [(0, 0), (0, 1), (5, 9)])
def test_split_never_overlaps(seeds):
    """Held-out keys never appear in train, across seeds, streams and wordings."""
    train_task = ArithmeticTask(seed=seeds[0], max_operand=30, style="mixed")
    held_task = ArithmeticTask(seed=seeds[1], max_operand=30)
    heldout = {ex.key for ex in held_task.heldout_examples(80)}
    train = {ex.key for s in (0, 1) for ex in train_task.train_examples(3000, stream=s)}
    assert len(heldout) == 80 and len(train) > 500
    assert not heldout & train
    # The split is the hash rule, whatever the generator does.
    assert all(held_task.is_heldout(k) for k in heldout)
    assert not any(held_task.is_heldout(k) for k in train)


def test_heldout_fraction_and_exhaustion():
    task = ArithmeticTask(max_operand=99, ops=("+",))
    keys = [f"{a}+{b}" for a in range(100) for b in range(100)]
    frac = sum(task.is_heldout(k) for k in keys) / len(keys)
    assert 0.08 < frac < 0.12  # heldout_fraction=0.1 over 10,000 problems.
    tiny = ArithmeticTask(max_operand=3, ops=("+",), heldout_fraction=0.2)
    n_held = sum(tiny.is_heldout(f"{a}+{b}") for a in range(4) for b in range(4))
    assert len(tiny.heldout_examples(n_held)) == n_held
    with pytest.raises(ValueError, match="distinct held-out problems"):
        tiny.heldout_examples(n_held + 1)


def test_word_styles():
    task = ArithmeticTask(style="words", ops=("+", "-", "*"), seed=1)
    exs = task.train_examples(200)
    assert all(any(w in ex.prompt for w in (" plus ", " minus ", " times ")) for ex in exs)
    assert all(len(ex.prompt) <= 24 for ex in exs)
    # Same problems as the symbolic style: wording is drawn after the problem.
    sym = dataclasses.replace(task, style="symbolic").train_examples(200)
    assert [e.key for e in exs] == [e.key for e in sym]
    for ex in exs:
        CharTokenizer().encode_ids(ex.prompt + ex.answer)


def test_negative_answers_knob():
    task = ArithmeticTask(ops=("-",), allow_negative=True)
    assert any(ex.answer.startswith("-") for ex in task.train_examples(100))
    assert not any(
        ex.answer.startswith("-") for ex in ArithmeticTask(ops=("-",)).train_examples(100)
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"ops": ("/",)}, "ops"),
        ({"style": "poem"}, "style"),
        ({"num_operands": 1}, "min_operands"),
        ({"min_operand": 5, "max_operand": 2}, "max_operand"),
        ({"heldout_fraction": 0.0}, "heldout_fraction"),
    ],
)
def test_bad_knobs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(**kwargs)
