"""Tasks: the embedded arithmetic generator and math datasets from local jsonl/parquet files.

Public API:

- `Example(prompt, answer, key="", index=-1, target="")`: one prompt (text that ends where the
  model should answer) and its ground truth (`answer`, a string the reward compares against).
  `target` is the full reference response for supervised warm-up when it is more than the
  answer (the running-sum task's worked sum); "" means the reference response is `answer`. The
  engine appends EOS to responses, so a perfect arithmetic response is exactly `answer`.
- `GeneratedTask`: the base class of the generated tasks (this `ArithmeticTask` and
  `dvp_jax.data.running_sum.RunningSumTask`), with the interface below; test
  `isinstance(x, GeneratedTask)` to accept either. `in_hash_fraction(key, salt, fraction)` is
  their held-out rule.
- `ArithmeticTask(seed=0, num_operands=2, min_operands=None, min_operand=0, max_operand=49,
  ops=("+", "-"), allow_negative=False, style="symbolic", heldout_fraction=0.1)`: generated
  problems with an integer answer, no download.
  - `train_example(i, stream=0) -> Example`: problem `i` of the train split, a pure function of
    (seed, stream, i). Use different `stream`s for independent draws from the same split
    (the pipeline uses 0 for RL prompts, 1 for supervised warm-up).
  - `train_examples(n, start=0, stream=0) -> list[Example]`.
  - `heldout_examples(n) -> list[Example]`: `n` distinct held-out problems, a pure function of
    (seed, n); raises when the held-out split has fewer than `n` problems.
  - `is_heldout(key) -> bool`.
  Split: a problem belongs to the held-out split iff the BLAKE2b hash of its canonical key (the
  symbolic expression, e.g. "12+34", whatever the wording) falls in the first
  `heldout_fraction` of the hash range. It depends on the key only (not the seed, the style or the
  stream), so train and held-out never overlap across seeds or templates; train generation
  rejects held-out draws.
  Difficulty knobs: operand count (uniform in [min_operands, num_operands]), operand range,
  allowed ops (`+ - *`, usual precedence), negative answers, and the wording:
  `style="symbolic"` ("12+34="), `"words"` ("what is 12 plus 34? ", "12 plus 34 is ",
  "12 plus 34 equals ") or `"mixed"` (either, chosen per problem).
  The default (2 operands in 0..49, + and -, symbolic, non-negative answers) gives prompts of at
  most 6 characters ("49-12=") and answers of 1-2 digits; its held-out split has about 370
  distinct problems (5,000 expressions, ~3,800 with a non-negative answer, 10%). Measured here:
  a 0.8M-parameter decoder reaches ~30% greedy held-out accuracy after 300 supervised steps of
  64 sequences and ~50% after 900 (2 shared CPU cores, ~2.5 min); with max_operand=99, ~10%
  after 1,000 steps.
- `load_math_dataset(path, tokenizer, *, max_prompt_tokens, chat_format="chatml",
  add_bos=None, process_index=0, process_count=1) -> (list[Example], LoadReport)`: rows of a
  local `.jsonl` / `.json` (one object per line) or `.parquet` file in the DAPO-Math layout:
  - prompt: `prompt` (or, when absent, `problem` / `question`) as a string or as chat messages
    (a non-empty list of `{"role": str, "content": str}`), rendered by `render_messages`;
  - ground truth: `reward_model.ground_truth`, else `answer`; a non-empty string or an integer.
  Row `r` (0-based line number for jsonl, row number for parquet; whitespace-only lines are not
  rows but keep their line number) is parsed and validated by host `r % process_count ==
  process_index` only (a jsonl file is scanned line by line; a parquet file is read as a table
  and only this host's rows are converted).
  Malformed rows (invalid JSON, a JSON integer longer than Python's int-string limit of 4,300
  digits, JSON nested deeper than the recursion limit, not an object, missing field, wrong type,
  empty, undecodable UTF-8, a parquet value Python cannot represent, text the tokenizer rejects,
  prompt longer than `max_prompt_tokens` tokens incl. BOS) are skipped, logged with absl and
  listed in the `LoadReport` (`num_malformed`, `malformed_indices`, `malformed` = [(row,
  reason)]); they never stop the load. Only the data errors a row can cause are caught
  (`_ROW_ERRORS`: ValueError incl. UnicodeError, TypeError, OverflowError, RecursionError); any
  other exception is a bug and propagates, noted with the path and row. File-level problems
  (missing file, unreadable or corrupt parquet) raise an error naming the path. A parquet file is
  converted for the columns used above only, so a bad value in another column never costs a row.
- `render_messages(messages, chat_format)`: "chatml" (Qwen's `<|im_start|>role\\n...<|im_end|>`
  turns followed by the assistant header) or "plain" (contents joined by newlines).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from dvp_jax.workdir import as_path

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
    """Generated arithmetic problems with an integer answer (see module docstring)."""

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


# ----------------------------------------------------------------------------------------------
# Math datasets (DAPO-Math layout)
# ----------------------------------------------------------------------------------------------

_CHAT_FORMATS = ("chatml", "plain")
_PROMPT_FIELDS = ("prompt", "problem", "question")
_LOG_FIRST_N = 20
# What one bad row can raise while it is parsed, converted and tokenized: json's errors (a
# JSONDecodeError, or a ValueError for an integer over sys.get_int_max_str_digits() digits), a
# RecursionError for nesting deeper than the interpreter's limit, UnicodeError (a ValueError),
# pyarrow's conversion errors (ArrowInvalid is a ValueError; OverflowError for out-of-range
# dates), a TypeError for a value of the wrong kind, and the tokenizer's ValueError. Anything
# else (AttributeError, NameError, ...) is a bug and is not swallowed.
_ROW_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


class _Malformed(Exception):
    """A row problem; the message is the reason stored in the report."""


@dataclasses.dataclass
class LoadReport:
    """What happened to the rows of one file on this host.

    `num_rows` counts the rows this host read (its shard); `malformed` lists (row index, reason)
    for every skipped row, row indices being global (file) positions.
    """

    path: str
    num_rows: int = 0
    num_loaded: int = 0
    malformed: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def num_malformed(self) -> int:
        return len(self.malformed)

    @property
    def malformed_indices(self) -> list[int]:
        return [i for i, _ in self.malformed]

    def summary(self) -> str:
        head = ", ".join(str(i) for i in self.malformed_indices[:50])
        more = " ..." if self.num_malformed > 50 else ""
        return (
            f"{self.path}: {self.num_rows} rows read, {self.num_loaded} loaded, "
            f"{self.num_malformed} malformed skipped (rows: {head}{more})"
        )


def render_messages(messages: Sequence[dict[str, str]], chat_format: str = "chatml") -> str:
    """Chat messages -> prompt text ending where the assistant's answer starts."""
    if chat_format == "chatml":
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"
    if chat_format == "plain":
        return "\n".join(m["content"] for m in messages)
    raise ValueError(f"chat_format must be one of {_CHAT_FORMATS}, got {chat_format!r}")


def _short(e: BaseException, limit: int = 300) -> str:
    """An exception's message cut to `limit` characters (a reason line, not a data dump)."""
    text = str(e)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_text(value: Any, what: str) -> str:
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Malformed(f"{what}: undecodable UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(value, str):
        raise _Malformed(f"{what}: expected a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Malformed(f"{what}: undecodable text (unpaired surrogate)") from None
    if not value.strip():
        raise _Malformed(f"{what}: empty")
    return value


def _row_to_example(row: Any, index: int, chat_format: str) -> Example:
    if not isinstance(row, dict):
        raise _Malformed(f"row is a {type(row).__name__}, not an object")
    field = next((f for f in _PROMPT_FIELDS if row.get(f) is not None), None)
    if field is None:
        raise _Malformed(f"missing prompt (none of {list(_PROMPT_FIELDS)})")
    prompt = row[field]
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise _Malformed(f"{field}: empty message list")
        messages = []
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise _Malformed(f"{field}[{j}]: expected {{'role', 'content'}}, got {m!r:.60}")
            messages.append(
                {
                    "role": _check_text(m["role"], f"{field}[{j}].role"),
                    "content": _check_text(m["content"], f"{field}[{j}].content"),
                }
            )
        text = render_messages(messages, chat_format)
    else:
        text = _check_text(prompt, field)

    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        truth, where = reward_model["ground_truth"], "reward_model.ground_truth"
    elif row.get("answer") is not None:
        truth, where = row["answer"], "answer"
    else:
        raise _Malformed("missing ground truth (reward_model.ground_truth or answer)")
    if isinstance(truth, (int, np.integer)) and not isinstance(truth, (bool, np.bool_)):
        truth = str(int(truth))
    truth = _check_text(truth, where).strip()
    return Example(prompt=text, answer=truth, key=f"row{index}", index=index)


def _jsonl_rows(path: str, process_index: int, process_count: int):
    """Yields (row index, parsed object or _Malformed) for this host's lines."""
    with as_path(path).open("rb") as f:
        for index, raw in enumerate(f):
            if index % process_count != process_index or not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield index, _Malformed(f"undecodable UTF-8 ({e.reason} at byte {e.start})")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row = _Malformed(f"invalid JSON ({e.msg} at column {e.colno})")
            except RecursionError:
                row = _Malformed(
                    f"invalid JSON: nested deeper than Python's recursion limit "
                    f"({sys.getrecursionlimit()})"
                )
            except ValueError as e:  # e.g. an integer over the int-string digit limit.
                row = _Malformed(f"invalid JSON value ({_short(e)})")
            yield index, row


def _parquet_rows(path: str, process_index: int, process_count: int):
    """Yields (row index, row dict or _Malformed) for this host's rows."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pyarrow is a test extra; a parquet user needs it installed.
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    import pyarrow as pa

    try:
        with as_path(path).open("rb") as f:  # any epath backend (gs://...)
            table = pq.read_table(f)
    except pa.ArrowException as e:  # A file-level problem: corrupt or not parquet.
        raise ValueError(f"{path}: cannot read as parquet: {e}") from e
    used = [c for c in (*_PROMPT_FIELDS, "reward_model", "answer") if c in table.column_names]
    indices = np.arange(process_index, table.num_rows, process_count)
    shard = table.select(used).take(indices)
    try:
        rows = shard.to_pylist()
    except _ROW_ERRORS:  # e.g. invalid UTF-8 in a string column: convert one row at a time.
        rows = []
        for j in range(shard.num_rows):
            try:
                rows.append(shard.slice(j, 1).to_pylist()[0])
            except _ROW_ERRORS as e:
                rows.append(_Malformed(f"undecodable row ({type(e).__name__}: {_short(e)})"))
    yield from zip(indices.tolist(), rows, strict=True)


def load_math_dataset(
    path: str | os.PathLike,
    tokenizer,
    *,
    max_prompt_tokens: int,
    chat_format: str = "chatml",
    add_bos: bool | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[list[Example], LoadReport]:
    """Loads this host's shard of a math jsonl/parquet file (see module docstring)."""
    path = os.fspath(path)
    if chat_format not in _CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {_CHAT_FORMATS}, got {chat_format!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"need 0 <= process_index < process_count, got {process_index}, {process_count}"
        )
    if not as_path(path).exists():
        raise FileNotFoundError(f"math dataset {path!r} does not exist; check the data path")
    ext = as_path(path).suffix.lower()
    if ext in (".jsonl", ".json"):
        rows = _jsonl_rows(path, process_index, process_count)
    elif ext == ".parquet":
        rows = _parquet_rows(path, process_index, process_count)
    else:
        raise ValueError(f"{path}: unsupported extension {ext!r}; use .jsonl, .json or .parquet")
    add_bos = getattr(tokenizer, "add_bos", True) if add_bos is None else add_bos

    report = LoadReport(path=path)
    examples = []
    for index, row in rows:
        report.num_rows += 1
        try:
            if isinstance(row, _Malformed):
                raise row
            ex = _row_to_example(row, index, chat_format)
            try:
                n_tokens = len(tokenizer.encode_ids(ex.prompt)) + int(add_bos)
            except _ROW_ERRORS as e:  # The tokenizer's message is the reason.
                raise _Malformed(f"tokenizer rejected the prompt: {_short(e)}") from None
            if n_tokens > max_prompt_tokens:
                raise _Malformed(
                    f"prompt has {n_tokens} tokens > max_prompt_tokens={max_prompt_tokens}"
                )
        except (_Malformed, *_ROW_ERRORS) as e:
            reason = str(e) if isinstance(e, _Malformed) else f"{type(e).__name__}: {_short(e)}"
            report.malformed.append((index, reason))
            if report.num_malformed <= _LOG_FIRST_N:
                logging.warning("%s: skipping malformed row %d: %s", path, index, reason)
            continue
        except Exception as e:
            e.add_note(f"while loading row {index} of {path}")
            raise
        examples.append(ex)
    report.num_loaded = len(examples)
    if report.num_malformed:
        logging.warning("%s", report.summary())
    else:
        logging.info("%s", report.summary())
    return examples, report
