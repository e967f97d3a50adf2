"""Math datasets: the prompts and ground truths of a local jsonl / parquet file or a local
Hugging Face datasets directory (`Dataset.save_to_disk`: arrow stream shards + state.json).

`load_math_dataset` reads this host's rows (row r goes to host r % process_count) into `Example`s.
Which fields hold the prompt (a string or chat messages rendered by `render_messages`), the
ground truth and an optional system prompt is `RowFields`; the defaults read the DAPO-Math layout
(`prompt`, else `problem` / `question`; `reward_model.ground_truth`, else `answer`). A configured
field the file does not have is one error naming it, the file and the file's fields, before any
row is read. A malformed row (bad JSON or UTF-8, a missing or mistyped field, text the tokenizer
rejects, a prompt over `max_prompt_tokens`) is skipped, logged and listed with its index in the
`LoadReport`; it never stops the load. A file-level problem (missing, unreadable, corrupt)
raises an error naming the path. Not here: the generated tasks (`tasks`), the batching
(`pipeline`), converting public datasets to this layout (`prepare`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np
from absl import logging

from dvp_jax.data.chat import chat_renderer, render_messages
from dvp_jax.data.tasks import Example
from dvp_jax.workdir import as_path

# The DAPO-Math layout: where the default `RowFields` look, in order.
_PROMPT_FIELDS = ("prompt", "problem", "question")
_ANSWER_FIELDS = ("reward_model.ground_truth", "answer")
# Rows of a jsonl file whose fields are the file's fields (the check of `RowFields`).
_FIELD_SCAN_ROWS = 100
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


@dataclasses.dataclass(frozen=True)
class RowFields:
    """Which fields of a row hold what; a dotted name reaches into a nested object
    ("reward_model.ground_truth"). Empty: the DAPO-Math layout's fields (`_PROMPT_FIELDS`,
    `_ANSWER_FIELDS`, the first a row has) and no system prompt.

    Attributes:
      prompt: a string (used as it is) or a chat messages list [{"role", "content"}, ...].
      answer: the ground truth, a string or an integer.
      system: a system prompt string put before the prompt's messages (a string prompt then
        becomes the user message); a row without it has none.
    """

    prompt: str = ""
    answer: str = ""
    system: str = ""

    def prompt_fields(self) -> tuple[str, ...]:
        return (self.prompt,) if self.prompt else _PROMPT_FIELDS

    def answer_fields(self) -> tuple[str, ...]:
        return (self.answer,) if self.answer else _ANSWER_FIELDS

    def used(self) -> tuple[str, ...]:
        """Every field a row is read from."""
        return self.prompt_fields() + self.answer_fields() + ((self.system,) if self.system else ())

    def check(self, path: str, present: set[str]) -> None:
        """Raises ValueError, one line, unless the file's fields `present` (dotted names) hold
        each configured field (for the defaults: one of the layout's prompt fields)."""
        have = ", ".join(sorted(present)) or "none"
        for key, name in (("prompt_key", self.prompt), ("answer_key", self.answer)):
            if name and name not in present:
                raise ValueError(f"{key}={name!r} is not a field of {path}; its fields: {have}")
        if self.system and self.system not in present:
            raise ValueError(
                f"system_key={self.system!r} is not a field of {path}; its fields: {have}"
            )
        for name, key, defaults in (
            (self.prompt, "prompt_key", _PROMPT_FIELDS),
            (self.answer, "answer_key", _ANSWER_FIELDS),
        ):
            if not name and not present & set(defaults):
                what = key.split("_")[0]
                raise ValueError(
                    f"{path} has none of the default {what} fields {list(defaults)} (set "
                    f"{key}); its fields: {have}"
                )


def _lookup(row: dict, name: str) -> Any:
    """row["a"]["b"] for "a.b" (None where a level is missing or not an object)."""
    value = row
    for part in name.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _dotted_fields(row: Any, prefix: str = "") -> set[str]:
    """The dotted names of a row's fields, nested objects included."""
    if not isinstance(row, dict):
        return set()
    out = set()
    for k, v in row.items():
        out.add(prefix + str(k))
        out |= _dotted_fields(v, f"{prefix}{k}.")
    return out


def _schema_fields(schema, prefix: str = "") -> set[str]:
    """The dotted names of an arrow schema's fields, struct members included."""
    import pyarrow as pa

    out = set()
    for field in schema:
        out.add(prefix + field.name)
        if pa.types.is_struct(field.type):
            out |= _schema_fields(list(field.type), f"{prefix}{field.name}.")
    return out


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


def _messages(value: Any, field: str) -> list[dict[str, str]]:
    if not value:
        raise _Malformed(f"{field}: empty message list")
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _Malformed(f"{field}[{j}]: expected {{'role', 'content'}}, got {m!r:.60}")
        messages.append(
            {
                "role": _check_text(m["role"], f"{field}[{j}].role"),
                "content": _check_text(m["content"], f"{field}[{j}].content"),
            }
        )
    return messages


def _row_to_example(row: Any, index: int, chat_format: str, fields: RowFields) -> Example:
    if not isinstance(row, dict):
        raise _Malformed(f"row is a {type(row).__name__}, not an object")
    names = fields.prompt_fields()
    field = next((f for f in names if _lookup(row, f) is not None), None)
    if field is None:
        raise _Malformed(f"missing prompt (none of {list(names)})")
    prompt = _lookup(row, field)
    system = _lookup(row, fields.system) if fields.system else None
    if system is not None:
        system = _check_text(system, fields.system)
    if isinstance(prompt, (list, tuple)):
        messages = _messages(prompt, field)
    elif system is not None:  # a string prompt with a system prompt: the user's message
        messages = [{"role": "user", "content": _check_text(prompt, field)}]
    else:
        messages = None
        text = _check_text(prompt, field)
    if messages is not None:
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        text = render_messages(messages, chat_format)

    names = fields.answer_fields()
    where = next((f for f in names if _lookup(row, f) is not None), None)
    if where is None:
        raise _Malformed(f"missing ground truth ({' or '.join(names)})")
    truth = _lookup(row, where)
    if isinstance(truth, (int, np.integer)) and not isinstance(truth, (bool, np.bool_)):
        truth = str(int(truth))
    truth = _check_text(truth, where).strip()
    return Example(prompt=text, answer=truth, key=f"row{index}", index=index)


def _parse_line(raw: bytes) -> Any:
    """One jsonl line -> its object, or a `_Malformed` saying why not."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _Malformed(f"undecodable UTF-8 ({e.reason} at byte {e.start})")
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        return _Malformed(f"invalid JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return _Malformed(
            f"invalid JSON: nested deeper than Python's recursion limit ({sys.getrecursionlimit()})"
        )
    except ValueError as e:  # e.g. an integer over the int-string digit limit.
        return _Malformed(f"invalid JSON value ({_short(e)})")


def _jsonl_fields(path: str) -> set[str]:
    """The fields of a jsonl file: those of its first `_FIELD_SCAN_ROWS` object rows."""
    present, seen = set(), 0
    with as_path(path).open("rb") as f:
        for raw in f:
            if seen == _FIELD_SCAN_ROWS:
                break
            row = _parse_line(raw) if raw.strip() else None
            if isinstance(row, dict):
                present |= _dotted_fields(row)
                seen += 1
    return present


def _jsonl_rows(path: str, process_index: int, process_count: int):
    """Yields (row index, parsed object or _Malformed) for this host's lines."""
    with as_path(path).open("rb") as f:
        for index, raw in enumerate(f):
            if index % process_count != process_index or not raw.strip():
                continue
            yield index, _parse_line(raw)


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pyarrow is a test extra; a parquet user needs it installed.
        raise ImportError("reading parquet or a datasets directory needs pyarrow") from e
    return pa, pq


def read_table(path: str):
    """The arrow table of a parquet file or of a `Dataset.save_to_disk` directory (its
    state.json lists the arrow stream shards in order); ValueError naming the path if it is
    neither or cannot be read."""
    pa, pq = _pyarrow()
    root = as_path(path)
    try:
        if not root.is_dir():
            with root.open("rb") as f:  # any epath backend (gs://...)
                return pq.read_table(f)
        if (root / "dataset_dict.json").exists():
            splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
            raise ValueError(
                f"{path} is a DatasetDict; give one split's directory: "
                + ", ".join(f"{path}/{s}" for s in splits)
            )
        if not (root / "state.json").exists():
            raise ValueError(
                f"{path} is a directory without state.json: not a datasets save_to_disk "
                "directory (give a .jsonl, .parquet or such a directory)"
            )
        state = json.loads((root / "state.json").read_text())
        tables = []
        for entry in state.get("_data_files", []):
            with (root / entry["filename"]).open("rb") as f:
                tables.append(pa.ipc.open_stream(f).read_all())
        if not tables:
            raise ValueError(f"{path}/state.json lists no data files")
        return pa.concat_tables(tables)
    except pa.ArrowException as e:  # A file-level problem: corrupt or not parquet / arrow.
        kind = "a datasets directory" if root.is_dir() else "parquet"
        raise ValueError(f"{path}: cannot read as {kind}: {e}") from e
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}/state.json: not a datasets state file ({e})") from e


def _table_rows(table, fields: RowFields, process_index: int, process_count: int):
    """Yields (row index, row dict or _Malformed) for this host's rows of the columns used."""
    top = {name.split(".")[0] for name in fields.used()}
    used = [c for c in table.column_names if c in top]
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
    chat_format: str = "auto",
    add_bos: bool | None = None,
    process_index: int = 0,
    process_count: int = 1,
    fields: RowFields = RowFields(),
) -> tuple[list[Example], LoadReport]:
    """Loads this host's shard of a math `.jsonl` / `.json` (one object a line), `.parquet` file
    or `Dataset.save_to_disk` directory, reading the `fields` of each row.

    Row `r` (the 0-based line number of a jsonl file, whitespace-only lines keeping their
    number; the row number of a table) is parsed by host `r % process_count == process_index`
    only. A table is converted for the columns used only, so a bad value in another column
    costs no row. The fields are checked against the file's (a table's schema, the first
    `_FIELD_SCAN_ROWS` rows of a jsonl file) first: a missing one raises ValueError. Only the
    errors one row can cause (`_ROW_ERRORS`) mark it malformed; any other exception is a bug
    and propagates with the path and row in a note.

    Returns:
      (examples, report): the loaded `Example`s (key "row<r>", index r) and the `LoadReport`.
    """
    path = os.fspath(path)
    # Once per file: the tokenizer's chat template ("auto"), or a format name (`data.chat`).
    chat_format = chat_renderer(chat_format, tokenizer)
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"need 0 <= process_index < process_count, got {process_index}, {process_count}"
        )
    if not as_path(path).exists():
        raise FileNotFoundError(f"math dataset {path!r} does not exist; check the data path")
    ext = as_path(path).suffix.lower()
    if ext in (".jsonl", ".json"):
        fields.check(path, _jsonl_fields(path))
        rows = _jsonl_rows(path, process_index, process_count)
    elif ext == ".parquet" or as_path(path).is_dir():
        table = read_table(path)
        fields.check(path, _schema_fields(table.schema))
        rows = _table_rows(table, fields, process_index, process_count)
    else:
        raise ValueError(
            f"{path}: unsupported extension {ext!r}; use .jsonl, .json, .parquet or a datasets "
            "save_to_disk directory"
        )
    add_bos = getattr(tokenizer, "add_bos", True) if add_bos is None else add_bos

    report = LoadReport(path=path)
    examples = []
    for index, row in rows:
        report.num_rows += 1
        try:
            if isinstance(row, _Malformed):
                raise row
            ex = _row_to_example(row, index, chat_format, fields)
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
