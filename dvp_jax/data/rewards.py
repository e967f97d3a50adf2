"""Rewards (host side, pure Python): the built-in reward functions, a weighted list of them
parsed from one spec string, and the scorer that sums them.

A spec is "name[=weight],..." (weight a finite float, default 1.0), e.g.
"math_verify=1.0,math_format=0.1,my_pkg.my_mod:my_fn=0.5". A name is a built-in (`BUILTINS`:
verifiers, format rewards, length penalties) or a user function "module:function", imported
when the spec is parsed and called as `fn(response, answer) -> float` (no other arguments).
`parse_rewards(spec)` gives the `RewardTerm`s or raises one line naming the bad term and what is
allowed; `score(terms, ...)` gives the weighted total, each term's values and its failures: a
term that raises or returns a non-finite value scores 0 for that response, is counted, and
never stops the caller. Built-in verifiers still raise on a malformed ground truth (a caller
bug); `score` counts that as a failure. Not here: decoding tokens to text (`train/evaluation.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from dvp_jax.data.running_sum import ANSWER_MARKER

_INT_RE = re.compile(r"\s*([+-]?[0-9]+)")
_ANSWER_RE = re.compile(r"\s*[+-]?[0-9]+\s*")

# ----------------------------------------------------------------------------------------------
# Verifiers: response text + ground truth -> 0.0 or 1.0
# ----------------------------------------------------------------------------------------------


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
    tail = _marked_tail(response_text)
    return 1.0 if tail is not None and int(tail) == int(answer) else 0.0


def _marked_tail(response_text: str) -> str | None:
    """The text after the last `<ans>` if it is, stripped, exactly one integer; else None."""
    if not isinstance(response_text, str):
        return None
    at = response_text.rfind(ANSWER_MARKER)
    tail = response_text[at + len(ANSWER_MARKER) :] if at >= 0 else ""
    return tail if _ANSWER_RE.fullmatch(tail) else None


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


# ----------------------------------------------------------------------------------------------
# Format rewards: 1.0 iff the response states an answer in the task's form, right or wrong
# ----------------------------------------------------------------------------------------------


def integer_format_reward(response_text: str, answer: str) -> float:
    """1.0 iff the response starts with an integer (`parse_int`), the arithmetic task's form."""
    return 1.0 if parse_int(response_text) is not None else 0.0


def marked_format_reward(response_text: str, answer: str) -> float:
    """1.0 iff the text after the last `<ans>` is, stripped, exactly one integer (the running-sum
    task's form; `marked_answer_reward` without comparing the value)."""
    return 1.0 if _marked_tail(response_text) is not None else 0.0


_ANSWER_LINE_RE = re.compile(r"^[ \t]*Answer:[ \t]*\S", re.MULTILINE)
_BOXED = "\\boxed{"


def math_format_reward(response_text: str, answer: str) -> float:
    """1.0 iff the response holds a closed `\\boxed{...}` with non-blank contents (braces inside
    balanced) or a line starting "Answer:" with something after it (DAPO-Math's requested form,
    case-sensitive); else 0.0. The forms `math_verify_reward` reads first."""
    if not isinstance(response_text, str):
        return 0.0
    if _ANSWER_LINE_RE.search(response_text):
        return 1.0
    at = response_text.find(_BOXED)
    while at >= 0:
        depth, start = 1, at + len(_BOXED)
        for j in range(start, len(response_text)):
            depth += {"{": 1, "}": -1}.get(response_text[j], 0)
            if depth == 0:
                if response_text[start:j].strip():
                    return 1.0
                break
        at = response_text.find(_BOXED, at + 1)
    return 0.0


# ----------------------------------------------------------------------------------------------
# Length penalties: response lengths in tokens [N] (stop token included) -> [N] values in [-1, 0]
# ----------------------------------------------------------------------------------------------


def truncated_penalty(
    lengths: np.ndarray, finished: np.ndarray, max_decode_length: int | None
) -> np.ndarray:
    """-1.0 for a response cut at `max_decode_length` (no stop token), 0.0 otherwise."""
    return np.where(np.asarray(finished, bool), 0.0, -1.0)


def soft_overlong_penalty(
    lengths: np.ndarray,
    finished: np.ndarray,
    max_decode_length: int | None,
    buffer: int | None = None,
) -> np.ndarray:
    """DAPO's soft overlong punishment. With L the response length in tokens, L_max =
    `max_decode_length` and B = `buffer` (default max(1, L_max // 5), DAPO's 4096 of 20480;
    at most L_max):

        R(L) = 0                          if L <= L_max - B
             = (L_max - B - L) / B        if L_max - B < L <= L_max

    so R falls linearly from 0 to -1 over the last B tokens, and a cut response (L = L_max)
    gets -1."""
    if max_decode_length is None:
        raise ValueError("soft_overlong needs max_decode_length (the rollout's)")
    b = max(1, max_decode_length // 5) if buffer is None else min(buffer, max_decode_length)
    start = max_decode_length - b
    lengths = np.asarray(lengths, np.float64)
    return np.where(lengths <= start, 0.0, (start - lengths) / b)


# ----------------------------------------------------------------------------------------------
# Reward specs and the scorer
# ----------------------------------------------------------------------------------------------

_TEXT_REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match_reward,
    "marked_answer": marked_answer_reward,
    "math_verify": math_verify_reward,
    "integer_format": integer_format_reward,
    "marked_format": marked_format_reward,
    "math_format": math_format_reward,
}
_LENGTH_REWARDS: dict[str, Callable[..., np.ndarray]] = {
    "truncated": truncated_penalty,
    "soft_overlong": soft_overlong_penalty,
}
BUILTINS = (*_TEXT_REWARDS, *_LENGTH_REWARDS)
_WITH_ARGUMENT = {"soft_overlong": "buffer"}  # "soft_overlong(512)": buffer = 512 tokens
_ALLOWED = (
    f"allowed: 'name[=weight],...' with names from the built-ins {list(BUILTINS)} "
    "(soft_overlong(<buffer tokens>) too) or a user function 'module:function'"
)
_ARGUMENT_RE = re.compile(r"(\w+)\((.*)\)")


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One weighted term of the reward. `name` is what the metrics call it (`reward/<name>`):
    the built-in's name, or "module.function" for "module:function". `fn` is
    `fn(response, answer) -> float`, or with `on_length` a length penalty
    `fn(lengths [N], finished [N], max_decode_length) -> [N]`."""

    name: str
    fn: Callable
    weight: float = 1.0
    on_length: bool = False


@dataclasses.dataclass(frozen=True)
class RewardScores:
    """`score`'s result for N responses.

    Attributes:
      total: [N] float32, sum_k weight_k * values[k].
      values: term name -> [N] float32, the term's unweighted values (0 where it failed, and
        for a text term on a cut response).
      failures: term name -> responses on which the term raised or returned a non-finite value.
    """

    total: np.ndarray
    values: dict[str, np.ndarray]
    failures: dict[str, int]


def parse_rewards(spec: str) -> tuple[RewardTerm, ...]:
    """The terms of `spec` ("name[=weight],...", see the module docstring), user functions
    imported; a bad term raises ValueError, one line naming it and what is allowed."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"the reward spec is empty or not a string: {spec!r}; {_ALLOWED}")
    terms: dict[str, RewardTerm] = {}
    for part in spec.split(","):
        name, has_weight, weight = (s.strip() for s in part.partition("="))
        if not name:
            raise ValueError(f"reward spec {spec!r} has an empty term; {_ALLOWED}")
        term = _term(name, _weight(name, weight) if has_weight else 1.0)
        if term.name in terms:
            raise ValueError(f"reward {term.name!r} appears twice in {spec!r}; {_ALLOWED}")
        terms[term.name] = term
    return tuple(terms.values())


def _weight(name: str, text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not math.isfinite(weight):
        raise ValueError(
            f"reward {name!r}: the weight must be a finite float, got {text!r}; {_ALLOWED}"
        )
    return weight


def _term(name: str, weight: float) -> RewardTerm:
    if name in _TEXT_REWARDS:
        return RewardTerm(name, _TEXT_REWARDS[name], weight)
    if name in _LENGTH_REWARDS:
        return RewardTerm(name, _LENGTH_REWARDS[name], weight, on_length=True)
    m = _ARGUMENT_RE.fullmatch(name)
    if m and m.group(1) in _WITH_ARGUMENT:
        base, arg = m.group(1), m.group(2).strip()
        if not arg.isdecimal() or int(arg) < 1:
            raise ValueError(
                f"reward {name!r}: the {_WITH_ARGUMENT[base]} must be an int >= 1; {_ALLOWED}"
            )
        fn = functools.partial(_LENGTH_REWARDS[base], **{_WITH_ARGUMENT[base]: int(arg)})
        return RewardTerm(base, fn, weight, on_length=True)
    if ":" in name:
        module, _, attr = (s.strip() for s in name.partition(":"))
        return RewardTerm(f"{module}.{attr}", _import(name, module, attr), weight)
    raise ValueError(f"reward {name!r} is neither a built-in nor 'module:function'; {_ALLOWED}")


def _import(name: str, module: str, attr: str) -> Callable:
    """`module`'s attribute `attr` (dotted for a nested one), which must be callable."""
    if not module or not attr:
        raise ValueError(f"reward {name!r} is not 'module:function'; {_ALLOWED}")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is the spec's error, by name.
        why = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        raise ValueError(
            f"reward {name!r}: module {module!r} does not import ({why}); {_ALLOWED}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward {name!r}: module {module!r} has no attribute {attr!r}; {_ALLOWED}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {name!r}: {module}.{attr} is not callable; {_ALLOWED}")
    return obj


def score(
    terms: Sequence[RewardTerm],
    responses: Sequence[str],
    answers: Sequence[str],
    *,
    finished: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
    max_decode_length: int | None = None,
) -> RewardScores:
    """The weighted reward of N responses and each term's values and failures.

    A text term is called on each response whose `finished` is True (default: all) and scores
    0 on the others without being called; a call that raises or returns a non-real or
    non-finite value scores 0, counts as a failure, and each failing term logs one warning per
    call. A length term (`on_length`) sees every response's `lengths` (tokens, stop token
    included) and `finished`; `max_decode_length` is needed by "soft_overlong" only.
    """
    n = len(responses)
    if len(answers) != n:
        raise ValueError(f"{n} responses but {len(answers)} ground truths")
    finished = np.ones(n, bool) if finished is None else np.asarray(finished, bool)
    total = np.zeros(n, np.float64)
    values, failures = {}, {}
    for term in terms:
        if term.on_length:
            if lengths is None:
                raise ValueError(f"reward {term.name!r} needs the response lengths")
            v = np.asarray(term.fn(lengths, finished, max_decode_length), np.float64)
            failed, first = 0, None
        else:
            v, failed, first = _call_text_term(term, responses, answers, finished)
        if failed:
            logging.warning(
                "reward %s failed on %d of %d responses (scored 0); first: %s",
                term.name,
                failed,
                n,
                first,
            )
        total += term.weight * v
        values[term.name], failures[term.name] = v.astype(np.float32), failed
    return RewardScores(total.astype(np.float32), values, failures)


def _call_text_term(term: RewardTerm, responses, answers, finished) -> tuple[np.ndarray, int, str]:
    """([N] float64 values, failures, the first failure's description)."""
    v = np.zeros(len(responses), np.float64)
    failed, first = 0, ""
    for i in np.flatnonzero(finished):
        try:
            value = term.fn(responses[i], answers[i])
            ok = isinstance(value, numbers.Real) and math.isfinite(value)
            why = "" if ok else f"returned {value!r} for response {i}"
        except Exception as e:  # noqa: BLE001 - a failing reward scores 0, never a crash.
            ok, why = False, f"{type(e).__name__}: {e} (response {i})"
        if ok:
            v[i] = float(value)
        else:
            failed, first = failed + 1, first or " ".join(why.split())
    return v, failed, first


def compute_rewards(
    spec: str | Sequence[RewardTerm], responses: Sequence[str], ground_truths: Sequence[str]
) -> np.ndarray:
    """Total rewards [len(responses)] float32 of paired responses and ground truths, every
    response counted as finished (text terms only: a length term raises)."""
    terms = parse_rewards(spec) if isinstance(spec, str) else spec
    return score(terms, responses, ground_truths).total
