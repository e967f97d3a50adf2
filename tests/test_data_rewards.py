"""Rewards: exact match on the leading integer; math-verify equivalence that never raises."""

import threading

import numpy as np
import pytest

from dvp_jax.data import rewards


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("46", "46", 1.0),
        (" 46", "46", 1.0),
        ("46 is the answer", "46", 1.0),
        ("46.", "46", 1.0),
        ("46abc", "46", 1.0),
        ("046", "46", 1.0),
        ("-3", "-3", 1.0),
        ("+7", "7", 1.0),
        ("4612", "46", 0.0),  # Digits that run on belong to the number.
        ("x46", "46", 0.0),
        ("= 46", "46", 0.0),
        ("", "46", 0.0),
        ("45", "46", 0.0),
        ("3", "-3", 0.0),
        ("1,000", "1000", 0.0),
        ("\ufffd46", "46", 0.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert rewards.exact_match_reward(response, answer) == expected


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("+ 90 = 90 baba + 7 = 97 kobe <ans> 97", "97", 1.0),
        ("<ans>97", "97", 1.0),
        ("<ans> 097 ", "97", 1.0),
        ("<ans> -3", "-3", 1.0),
        ("<ans> 96 baba <ans> 97", "97", 1.0),  # The last marker counts.
        ("<ans> 97 baba <ans> 96", "97", 0.0),
        ("<ans> 97 baba", "97", 0.0),  # Words after the answer: not a marked answer.
        ("<ans> 9 7", "97", 0.0),
        ("<ans> 98", "97", 0.0),
        ("<ans>", "97", 0.0),
        ("+ 90 = 90 + 7 = 97", "97", 0.0),  # No marker.
        ("97", "97", 0.0),
        ("", "97", 0.0),
        ("<ans> 97\ufffd", "97", 0.0),
    ],
)
def test_marked_answer(response, answer, expected):
    assert rewards.marked_answer_reward(response, answer) == expected


def test_marked_answer_never_raises_on_the_response():
    assert rewards.marked_answer_reward(None, "1") == 0.0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integer string"):
        rewards.marked_answer_reward("<ans> 1", "one")


def test_exact_match_rejects_non_integer_answer():
    with pytest.raises(ValueError, match="integer string"):
        rewards.exact_match_reward("1", "1/2")


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the answer is \\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("The answer is $34$.", "34", 1.0),
        ("... Answer: \\boxed{34}", "34", 1.0),
        ("\\boxed{35}", "34", 0.0),
        ("I do not know", "34", 0.0),
        ("", "34", 0.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{", "34", 0.0),  # Broken LaTeX: a wrong answer, not a crash.
    ],
)
def test_math_verify(response, truth, expected):
    assert rewards.math_verify_reward(response, truth) == expected


def test_math_verify_never_raises():
    assert rewards.math_verify_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert rewards.math_verify_reward("\\boxed{1}", "\\frac{") in (0.0, 1.0)
    # Off the main thread math_verify's signal timeouts cannot run: still scores.
    out = []
    t = threading.Thread(target=lambda: out.append(rewards.math_verify_reward("\\boxed{2}", "2")))
    t.start()
    t.join()
    assert out == [1.0]


def test_compute_rewards():
    r = rewards.compute_rewards("exact_match", ["12", "13 ", "x"], ["12", "12", "1"])
    np.testing.assert_array_equal(r, np.array([1, 0, 0], np.float32))
    assert r.dtype == np.float32
    r = rewards.compute_rewards("marked_answer", ["a <ans> 12", "12"], ["12", "12"])
    np.testing.assert_array_equal(r, np.array([1, 0], np.float32))
    with pytest.raises(ValueError, match="'nope' is neither a built-in"):
        rewards.compute_rewards("nope", ["1"], ["1"])
