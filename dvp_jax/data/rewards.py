"""Reward functions (host side, pure Python): response text + ground truth -> 0.0 or 1.0.

One verifier per task kind (`compute_rewards(kind, ...)`, `get_reward_fn(kind)`): "exact_match"
(arithmetic: the leading integer), "marked_answer" (running sums: the integer after the last
`<ans>`) and "math_verify" (math data: `math_verify`'s equivalence of final answers). A
response never makes a reward raise (it scores 0.0); a malformed ground truth is a caller bug
and raises. Not here: decoding tokens to text and zeroing truncated responses
(`train/evaluation.py`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from dvp_jax.data.running_sum import ANSWER_MARKER

_INT_RE = re.compile(r"\s*([+-]?[0-9]+)")
_ANSWER_RE = re.compile(r"\s*[+-]?[0-9]+\s*")


def parse_int(text: str) -> int | None:
    """The integer `text` starts with, or None.

    Leading whitespace is skipped; then an optional sign and at least one ASCII digit must
    follow; the number ends at the first non-digit and the rest is ignored ("46", " 46",
    "46 is it", "46." give 46). Anything else first gives None ("x46", "= 46"). Digits that run
    on belong to the number ("4612" is 4612), so a model that does not stop is wrong. Leading
    zeros are accepted ("046" is 46); thousands separators are not ("1,000" is 1).
    """
    if not isinstance(text, str):
        return None
    m = _INT_RE.match(text)
    return int(m.group(1)) if m else None


def exact_match_reward(response_text: str, answer: str) -> float:
    """1.0 iff `parse_int(response_text)` equals the integer string `answer` ("46", "-3")."""
    if not isinstance(answer, str) or not _ANSWER_RE.fullmatch(answer):
        raise ValueError(f"exact_match_reward: answer must be an integer string, got {answer!r}")
    target = int(answer)
    return 1.0 if parse_int(response_text) == target else 0.0


def marked_answer_reward(response_text: str, answer: str) -> float:
    """1.0 iff the text after the LAST `<ans>` (`running_sum.ANSWER_MARKER`) is, stripped,
    exactly one integer equal to `answer`: "... <ans> 97" and "<ans>97" give 97; "<ans> 97 baba",
    "<ans>", "<ans> 9 7" and no marker give 0. What precedes the last marker is ignored; a sign
    and leading zeros are accepted as in `parse_int`."""
    if not isinstance(answer, str) or not _ANSWER_RE.fullmatch(answer):
        raise ValueError(f"marked_answer_reward: answer must be an integer string, got {answer!r}")
    if not isinstance(response_text, str):
        return 0.0
    at = response_text.rfind(ANSWER_MARKER)
    if at < 0:
        return 0.0
    tail = response_text[at + len(ANSWER_MARKER) :]
    if not _ANSWER_RE.fullmatch(tail):
        return 0.0
    return 1.0 if int(tail) == int(answer) else 0.0


def math_verify_reward(
    response_text: str, ground_truth: str, timeout_s: int = 5, max_chars: int = 4000
) -> float:
    """1.0 iff `math_verify` finds the response's final answer (last `\\boxed{}` or LaTeX /
    plain expression) equivalent to `ground_truth` ("\\boxed{1/2}" vs "0.5" gives 1.0), which is
    parsed as `\\boxed{gt}` first, then as is. Every exception scores 0.0 (logged at debug).
    Timeouts are math_verify's SIGALRM ones, `timeout_s` per parse and per comparison; they work
    only in the main thread, so off it they are off (logged once) and the response is cut to its
    last `max_chars` characters to bound the work."""
    try:
        from math_verify import parse, verify

        in_main = threading.current_thread() is threading.main_thread()
        timeout = timeout_s if in_main else None
        if not in_main:
            _warn_no_timeout_once()
            response_text = response_text[-max_chars:]
        gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
        if not gold:
            gold = parse(ground_truth, parsing_timeout=timeout)
        if not gold:
            logging.log_first_n(logging.WARNING, "unparseable ground truth %r", 10, ground_truth)
            return 0.0
        pred = parse(response_text, parsing_timeout=timeout)
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # noqa: BLE001 - a verifier failure is a wrong answer, never a crash.
        logging.debug("math_verify_reward failed on %r", response_text[:200], exc_info=True)
        return 0.0


_NO_TIMEOUT_WARNED = threading.Event()


def _warn_no_timeout_once() -> None:
    if not _NO_TIMEOUT_WARNED.is_set():
        _NO_TIMEOUT_WARNED.set()
        logging.warning(
            "math_verify_reward called off the main thread: math_verify's SIGALRM timeouts are "
            "disabled; responses are cut to their last max_chars characters instead"
        )


_REWARD_FNS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match_reward,
    "marked_answer": marked_answer_reward,
    "math_verify": math_verify_reward,
}


def get_reward_fn(kind: str) -> Callable[[str, str], float]:
    if kind not in _REWARD_FNS:
        raise ValueError(f"reward kind must be one of {sorted(_REWARD_FNS)}, got {kind!r}")
    return _REWARD_FNS[kind]


def compute_rewards(
    kind: str, responses: Sequence[str], ground_truths: Sequence[str]
) -> np.ndarray:
    """Rewards [len(responses)] float32 for paired responses and ground truths."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    fn = get_reward_fn(kind)
    return np.asarray([fn(r, g) for r, g in zip(responses, ground_truths, strict=True)], np.float32)
