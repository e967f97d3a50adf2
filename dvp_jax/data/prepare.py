"""`python -m dvp_jax.data.prepare`: public math datasets, as local files, -> the training layout.

  python -m dvp_jax.data.prepare --format dapo17k_processed \
    --input /data/raw/DAPO-Math-17k-Processed/en/train-00000-of-00001.parquet \
    --out /data/dapo_math_17k_filtered.parquet

Formats (`--format`, or `auto` from each file's columns): `dapo17k`
(BytedTsinghua-SIA/DAPO-Math-17k: prompt messages, reward_model.ground_truth, data_source,
extra_info.index; its rows repeat problems), `dapo17k_processed`
(open-r1/DAPO-Math-17k-Processed: prompt string, solution, source_prompt messages, ...) and
`aime25` (math-ai/aime25: problem, answer, id; opencompass/AIME2025: question, answer), whose
bare problems get DAPO's instruction (`--template dapo`) so they are asked as the training
problems are. Output (jsonl or parquet by `--out`'s extension): the DAPO layout the loader reads
by default (`math_data`). Rows without a prompt or an answer are counted and skipped;
`--dedupe` (default) keeps the first row of each problem. Not here: downloading (no network).
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import app, flags

from dvp_jax.cli import USAGE_EXIT_CODE, fail, parse_flags

FORMATS = ("dapo17k", "dapo17k_processed", "aime25")
# DAPO-Math-17k's instruction around each problem (its prompts' exact text).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
TEMPLATES = ("dapo", "none")

# The command's flags, defined only when it runs as one (absl's registry is global).
_FLAGS: dict = {}


class _Bad(Exception):
    """A row that cannot be converted; the message is the reason."""


def _text(value, what: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise _Bad(f"{what}: expected a non-empty string, got {value!r:.40}")
    return value.strip()


def _user_message(row: dict, what: str) -> list[dict]:
    messages = row.get(what)
    if not isinstance(messages, list) or not messages:
        raise _Bad(f"{what}: expected a chat messages list")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise _Bad(f"{what}: a message is not an object")
        out.append({"content": _text(m.get("content"), f"{what}.content"), "role": m.get("role")})
    return out


def _nested(row: dict, outer: str, inner: str):
    value = row.get(outer)
    return value.get(inner) if isinstance(value, dict) else None


def convert_row(row: dict, fmt: str, index: int, template: str = "dapo") -> dict:
    """One input row -> one row of the DAPO layout; raises `_Bad` naming what is missing."""
    if fmt == "dapo17k":
        prompt = _user_message(row, "prompt")
        answer = _text(_nested(row, "reward_model", "ground_truth"), "reward_model.ground_truth")
        source, rid = row.get("data_source") or "math_dapo", _nested(row, "extra_info", "index")
    elif fmt == "dapo17k_processed":
        if isinstance(row.get("source_prompt"), list):
            prompt = _user_message(row, "source_prompt")
        else:
            prompt = [{"content": _text(row.get("prompt"), "prompt"), "role": "user"}]
        truth = row.get("solution")
        answer = _text(
            truth if truth is not None else _nested(row, "reward_model", "ground_truth"), "solution"
        )
        source, rid = row.get("data_source") or "math_dapo", _nested(row, "extra_info", "index")
    elif fmt == "aime25":
        field = "problem" if row.get("problem") is not None else "question"
        problem = _text(row.get(field), "problem (or question)")
        content = DAPO_PREFIX + problem + DAPO_SUFFIX if template == "dapo" else problem
        prompt = [{"content": content, "role": "user"}]
        answer = _text(row.get("answer"), "answer")
        source, rid = "aime25", row.get("id")
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    return {
        "data_source": str(source),
        "prompt": prompt,
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": str(rid if rid is not None else index)},
    }


def problem_key(row: dict) -> str:
    """The problem of a converted row, instruction stripped, whitespace collapsed, casefolded:
    rows with the same key are duplicates."""
    text = " ".join(m["content"] for m in row["prompt"] if m.get("role") != "system")
    text = text.removeprefix(DAPO_PREFIX.strip()).strip().removesuffix(DAPO_SUFFIX.strip())
    return re.sub(r"\s+", " ", text).strip().casefold()


def detect_format(columns: set[str]) -> str:
    """The format of a file with these top-level columns; ValueError if none fits."""
    if {"solution", "source_prompt"} <= columns or {"prompt", "solution"} <= columns:
        return "dapo17k_processed"
    if {"prompt", "reward_model"} <= columns:
        return "dapo17k"
    if "answer" in columns and columns & {"problem", "question"}:
        return "aime25"
    raise ValueError(
        f"no format fits the columns {sorted(columns)}: pass --format (one of {FORMATS})"
    )


_REQUIRED = {
    "dapo17k": ({"prompt"}, {"reward_model"}),
    "dapo17k_processed": ({"prompt", "source_prompt"}, {"solution", "reward_model"}),
    "aime25": ({"problem", "question"}, {"answer"}),
}


def read_rows(path: str) -> tuple[list, set[str]]:
    """(rows, top-level columns) of a jsonl / parquet file or a datasets directory; a jsonl line
    that is not JSON is kept as a `_Bad` row (counted, never fatal)."""
    from dvp_jax.data import math_data

    if not os.path.exists(path):
        raise ValueError(f"--input {path}: no such file or directory")
    if path.endswith((".jsonl", ".json")):
        rows, columns = [], set()
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    row = _Bad(f"invalid JSON ({e})")
                if isinstance(row, dict):
                    columns |= set(row)
                rows.append(row)
        return rows, columns
    table = math_data.read_table(path)
    return table.to_pylist(), set(table.column_names)


def write_rows(rows: list[dict], out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if out.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def prepare(inputs, fmt: str, out: str, dedupe: bool = True, template: str = "dapo") -> dict:
    """Converts `inputs` into `out`; returns the counts (also printed, one line per file)."""
    if not out.endswith((".jsonl", ".parquet")):
        raise ValueError(f"--out {out}: must end in .jsonl or .parquet")
    tables = [(path, *read_rows(path)) for path in inputs]  # every input read before writing
    written, seen = [], set()
    totals = {"read": 0, "malformed": 0, "duplicates": 0, "written": 0}
    for path, rows, columns in tables:
        this = detect_format(columns) if fmt == "auto" else fmt
        missing = ["|".join(sorted(o)) for o in _REQUIRED[this] if not columns & o]
        if missing:
            raise ValueError(
                f"--input {path} lacks format {this}'s columns {', '.join(missing)}; its "
                f"columns: {', '.join(sorted(columns)) or 'none'}"
            )
        counts = {"read": len(rows), "malformed": 0, "duplicates": 0, "written": 0}
        for index, row in enumerate(rows):
            try:
                if not isinstance(row, dict):
                    raise row if isinstance(row, _Bad) else _Bad("not an object")
                converted = convert_row(row, this, index, template)
            except _Bad:
                counts["malformed"] += 1
                continue
            key = problem_key(converted)
            if dedupe and key in seen:
                counts["duplicates"] += 1
                continue
            seen.add(key)
            written.append(converted)
            counts["written"] += 1
        print(
            f"{path} ({this}): {counts['read']} rows read, {counts['malformed']} malformed "
            f"skipped, {counts['duplicates']} duplicates dropped, {counts['written']} kept"
        )
        totals = {k: totals[k] + counts[k] for k in totals}
    write_rows(written, out)
    print(f"wrote {len(written)} rows to {out}")
    return totals


def _define_flags() -> None:
    f = _FLAGS
    f["input"] = flags.DEFINE_multi_string(
        "input", None, "Input file(s): jsonl, parquet or a datasets dir."
    )
    f["format"] = flags.DEFINE_enum(
        "format", "auto", [*FORMATS, "auto"], "Layout of the input files."
    )
    f["out"] = flags.DEFINE_string("out", None, "Output file, .jsonl or .parquet.")
    f["dedupe"] = flags.DEFINE_bool("dedupe", True, "Keep only the first row of each problem.")
    f["template"] = flags.DEFINE_enum(
        "template", "dapo", list(TEMPLATES), "Wrap a bare problem (aime25) in DAPO's instruction."
    )
    flags.mark_flags_as_required(["input", "out"])


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: every option is a --flag", USAGE_EXIT_CODE)
    try:
        f = {name: flag.value for name, flag in _FLAGS.items()}
        prepare(f["input"], f["format"], f["out"], f["dedupe"], f["template"])
    except (ValueError, OSError) as e:
        fail(" ".join(str(e).split()), USAGE_EXIT_CODE, e)
    sys.stdout.flush()


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=parse_flags)
