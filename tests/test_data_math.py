"""Math files (DAPO-Math layout): malformed rows are counted, reported by index and skipped."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dvp_jax.data import pipeline
from dvp_jax.data.math_data import load_math_dataset, render_messages
from dvp_jax.tokenizers import HFTokenizer

MAX_PROMPT_TOKENS = 64


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE trained here (no download); EOS "</s>", no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(["what is one plus two? solve the problem. user assistant"] * 50, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    t.save(str(path))
    return HFTokenizer(path, eos="</s>")


def msgs(text):
    return [{"role": "user", "content": text}]


LONG = "what is one plus two? " * 40  # Far more than MAX_PROMPT_TOKENS tokens.


def write_jsonl(path):
    """15 lines; returns (good line numbers, malformed line numbers)."""
    lines = [
        json.dumps({"prompt": msgs("what is 1+2?"), "reward_model": {"ground_truth": "3"}}),  # 0
        json.dumps({"prompt": "what is 2+2?", "answer": "4"}),  # 1
        '{"prompt": "broken json", ',  # 2 invalid JSON
        json.dumps({"prompt": msgs("no answer here")}),  # 3 missing ground truth
        json.dumps({"prompt": 17, "answer": "1"}),  # 4 wrong type
        b'{"prompt": "\xff\xfe bad bytes", "answer": "1"}',  # 5 undecodable
        "   ",  # 6 blank: not a row
        json.dumps({"problem": "what is 3+3?", "reward_model": {"ground_truth": "6"}}),  # 7
        json.dumps(["a", "list"]),  # 8 not an object
        json.dumps({"prompt": msgs(LONG), "answer": "1"}),  # 9 too long
        json.dumps({"prompt": ["not a message"], "answer": "1"}),  # 10 wrong type
        json.dumps({"prompt": "ok?", "reward_model": {"ground_truth": ["3"]}}),  # 11 wrong type
        json.dumps({"prompt": "what is 5+7?", "answer": 12}),  # 12 int answer is fine
        '{"prompt": "lone \\ud800 surrogate", "answer": "1"}',  # 13 undecodable text
        json.dumps({"prompt": "", "answer": "1"}),  # 14 empty
    ]
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return [0, 1, 7, 12], [2, 3, 4, 5, 8, 9, 10, 11, 13, 14]


def test_jsonl_malformed_rows_counted_and_skipped(tmp_path, tok):
    path = tmp_path / "data.jsonl"
    good, bad = write_jsonl(path)
    examples, report = load_math_dataset(path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert [ex.index for ex in examples] == good
    assert report.num_malformed == len(bad) and report.malformed_indices == bad
    assert (report.num_rows, report.num_loaded) == (14, 4)
    reasons = dict(report.malformed)
    assert "invalid JSON" in reasons[2] and "undecodable" in reasons[5]
    assert "ground truth" in reasons[3] and "max_prompt_tokens" in reasons[9]
    assert "undecodable" in reasons[13] and "empty" in reasons[14]
    assert [ex.answer for ex in examples] == ["3", "4", "6", "12"]
    assert examples[0].prompt == render_messages(msgs("what is 1+2?"), "chatml")
    assert examples[0].prompt.endswith("<|im_start|>assistant\n")
    assert examples[1].prompt == "what is 2+2?"
    assert "14 rows read, 4 loaded, 10 malformed" in report.summary()


def test_parquet_dapo_layout_malformed_rows(tmp_path, tok):
    rows = [
        {"prompt": msgs("what is 1+2?"), "reward_model": {"ground_truth": "3", "style": "rule"}},
        {"prompt": None, "reward_model": {"ground_truth": "3", "style": "rule"}},  # 1 missing
        {"prompt": msgs("two?"), "reward_model": None},  # 2 missing ground truth
        {"prompt": [{"role": "user", "content": None}], "reward_model": {"ground_truth": "1"}},
        {"prompt": msgs(LONG), "reward_model": {"ground_truth": "1", "style": "rule"}},  # 4
        {"prompt": [], "reward_model": {"ground_truth": "1", "style": "rule"}},  # 5 empty
        {"prompt": msgs("what is 3+3?"), "reward_model": {"ground_truth": "6", "style": "rule"}},
    ]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    examples, report = load_math_dataset(path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert [ex.index for ex in examples] == [0, 6]
    assert report.malformed_indices == [1, 2, 3, 4, 5] and report.num_malformed == 5
    assert [ex.answer for ex in examples] == ["3", "6"]


def test_parquet_undecodable_text(tmp_path, tok):
    prompts = pa.array([b"what is 1+2?", b"\xff\xfe bad", b"what is 2+2?"], pa.binary())
    table = pa.table({"prompt": prompts.view(pa.string()), "answer": ["3", "1", "4"]})
    path = tmp_path / "plain.parquet"
    pq.write_table(table, path)
    examples, report = load_math_dataset(path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert [ex.index for ex in examples] == [0, 2]
    assert report.malformed_indices == [1] and "undecodable" in report.malformed[0][1]


def test_host_shards_of_a_file_are_disjoint_and_cover(tmp_path, tok):
    path = tmp_path / "data.jsonl"
    good, bad = write_jsonl(path)
    seen_good, seen_bad = [], []
    for host in range(3):
        examples, report = load_math_dataset(
            path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS, process_index=host, process_count=3
        )
        assert all(ex.index % 3 == host for ex in examples)
        seen_good += [ex.index for ex in examples]
        seen_bad += report.malformed_indices
    assert sorted(seen_good) == good and sorted(seen_bad) == bad


def test_prompt_iterator_over_a_file(tmp_path, tok):
    path = tmp_path / "data.jsonl"
    good, bad = write_jsonl(path)
    it = pipeline.make_prompt_iterator(
        path, tok, batch_size=2, max_prompt_len=MAX_PROMPT_TOKENS, process_index=0, process_count=1
    )
    assert it.report.malformed_indices == bad
    batches = [next(it) for _ in range(4)]  # Two epochs of the 4 good rows.
    for b in batches:
        assert b.tokens.shape == (2, MAX_PROMPT_TOKENS)
        for row, n, idx, answer in zip(b.tokens, b.lengths, b.indices, b.answers, strict=True):
            assert idx in good and (row[n:] == tok.pad_id).all()
            assert answer == {0: "3", 1: "4", 7: "6", 12: "12"}[idx]
    assert sorted(i for b in batches[:2] for i in b.indices) == good


def test_rows_that_break_the_json_parser_are_skipped(tmp_path, tok):
    """A 5,000-digit integer (over Python's 4,300-digit int-string limit) or JSON
    nested 200k deep (RecursionError) aborted the whole load; each is now one skipped row."""
    huge = "9" * 5000
    lines = [
        json.dumps({"prompt": "what is 1+2?", "answer": "3"}),  # 0
        '{"prompt": "big", "answer": ' + huge + "}",  # 1 int-digit limit (ValueError)
        "[" * 200_000,  # 2 RecursionError (never closed)
        '{"prompt": "x", "reward_model": {"ground_truth": ' + huge + "}}",  # 3 digit limit
        json.dumps({"prompt": "what is 2+2?", "answer": 4}),  # 4
        '{"a": ' * 200_000 + "1" + "}" * 200_000,  # 5 RecursionError (closed, objects)
        b'{"prompt": "\xc3\x28 bad", "answer": "1"}',  # 6 invalid UTF-8
        '{"prompt": ' + "[" * 200_000 + "]" * 200_000 + ', "answer": "1"}',  # 7 Recursion
        json.dumps({"prompt": msgs("what is 3+3?"), "reward_model": {"ground_truth": "6"}}),  # 8
        '{"prompt": "x", "answer": 1e999}',  # 9 a float (inf), not a string or an integer
    ]
    path = tmp_path / "bad.jsonl"
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    examples, report = load_math_dataset(path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert [(ex.index, ex.answer) for ex in examples] == [(0, "3"), (4, "4"), (8, "6")]
    assert report.malformed_indices == [1, 2, 3, 5, 6, 7, 9]
    assert (report.num_rows, report.num_loaded) == (10, 3)
    reasons = dict(report.malformed)
    for i in (1, 3):
        assert "invalid JSON value" in reasons[i] and "4300 digits" in reasons[i], reasons[i]
    for i in (2, 5, 7):
        assert "nested deeper than Python's recursion limit" in reasons[i], reasons[i]
    assert "undecodable UTF-8" in reasons[6] and "expected a string, got float" in reasons[9]
    assert all(len(r) < 400 for r in reasons.values())  # A reason line, never the row itself.


def test_parquet_row_values_python_cannot_hold(tmp_path, tok):
    """A timestamp out of Python's datetime range (OverflowError) or invalid UTF-8 inside a
    chat message costs its row only; a bad value in a column the loader never reads costs
    nothing."""
    content = pa.array([b"what is 1+2?", b"ok", b"\xff bad", b"what is 3+3?"]).view(pa.string())
    message = pa.StructArray.from_arrays(
        [pa.array(["user"] * 4), content], names=["role", "content"]
    )
    prompt = pa.ListArray.from_arrays(pa.array([0, 1, 2, 3, 4], pa.int32()), message)
    truth = pa.StructArray.from_arrays([pa.array(["3", None, "1", "6"])], names=["ground_truth"])
    far = 2**62  # Milliseconds since 1970: far past datetime.MAXYEAR.
    table = pa.table(
        {
            "prompt": prompt,
            "reward_model": truth,
            "answer": pa.array([None, far, None, None], pa.timestamp("ms")),  # 1: OverflowError
            "extra_info": pa.array([0, 0, 0, far], pa.timestamp("ms")),  # unused column
        }
    )
    path = tmp_path / "dates.parquet"
    pq.write_table(table, path)
    examples, report = load_math_dataset(path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert [(ex.index, ex.answer) for ex in examples] == [(0, "3"), (3, "6")]
    assert report.malformed_indices == [1, 2]
    reasons = dict(report.malformed)
    assert "OverflowError" in reasons[1] and "UnicodeDecodeError" in reasons[2], reasons


def test_file_level_errors_name_the_path(tmp_path, tok):
    """A bug is not counted as a bad row; a missing or corrupt file raises, naming the path."""

    class BuggyTokenizer:
        add_bos = False

        def encode_ids(self, text):
            return text.no_such_method()  # An AttributeError: a bug, not a data problem.

    path = tmp_path / "data.jsonl"
    write_jsonl(path)
    with pytest.raises(AttributeError) as err:
        load_math_dataset(path, BuggyTokenizer(), max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert f"while loading row 0 of {path}" in err.value.__notes__

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_math_dataset(missing, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not a parquet file")
    with pytest.raises(ValueError, match="corrupt.parquet: cannot read as parquet"):
        load_math_dataset(corrupt, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)


# ----------------------------------------------------------------------------------------------
# Configurable fields, a datasets save_to_disk directory
# ----------------------------------------------------------------------------------------------


def _hf_feature(t) -> dict:
    """The `datasets` features JSON of an arrow type (strings, integers, structs, lists)."""
    if pa.types.is_struct(t):
        return {f.name: _hf_feature(f.type) for f in t}
    if pa.types.is_list(t):
        return {"feature": _hf_feature(t.value_type), "_type": "List"}
    return {"dtype": "string" if pa.types.is_string(t) else str(t), "_type": "Value"}


def write_hf_dataset(directory, table, shards: int = 2) -> None:
    """`table` laid out as `datasets.Dataset.save_to_disk` writes it: arrow IPC stream shards
    data-0000i-of-0000n.arrow, state.json listing them in order, dataset_info.json."""
    directory.mkdir(parents=True)
    per = -(-table.num_rows // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        with pa.OSFile(str(directory / name), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table.slice(i * per, per))
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (directory / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    features = {f.name: _hf_feature(f.type) for f in table.schema}
    info = {"citation": "", "description": "", "features": features, "homepage": ""}
    (directory / "dataset_info.json").write_text(json.dumps(info, indent=2))


def test_configured_fields_and_system_prompt(tmp_path, tok):
    from dvp_jax.data.math_data import RowFields

    rows = [
        {"question": "what is 1+2?", "meta": {"gold": 3}, "sys": "solve the problem."},  # 0
        {"question": msgs("what is 2+2?"), "meta": {"gold": "4"}},  # 1 no system: none
        {"question": "what is 3+3?", "meta": {}, "sys": "solve"},  # 2 no answer: malformed
        {"problem": "two?", "meta": {"gold": "2"}},  # 3 no configured prompt: malformed
    ]
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = RowFields(prompt="question", answer="meta.gold", system="sys")
    examples, report = load_math_dataset(
        path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS, fields=fields
    )
    assert [(ex.index, ex.answer) for ex in examples] == [(0, "3"), (1, "4")]
    system = [{"role": "system", "content": "solve the problem."}]
    assert examples[0].prompt == render_messages(system + msgs("what is 1+2?"), "chatml")
    assert examples[1].prompt == render_messages(msgs("what is 2+2?"), "chatml")
    assert report.malformed_indices == [2, 3]
    reasons = dict(report.malformed)
    assert "missing ground truth (meta.gold)" in reasons[2]
    assert "missing prompt (none of ['question'])" in reasons[3]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_dir"])
def test_a_field_the_file_lacks_is_one_line_before_any_row(tmp_path, tok, kind):
    from dvp_jax.data.math_data import RowFields

    rows = [{"problem": "what is 1+2?", "reward_model": {"ground_truth": "3"}, "id": "a"}] * 3
    table = pa.Table.from_pylist(rows)
    path = tmp_path / {"jsonl": "d.jsonl", "parquet": "d.parquet", "hf_dir": "d"}[kind]
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        pq.write_table(table, path)
    else:
        write_hf_dataset(path, table)
    have = "id, problem, reward_model, reward_model.ground_truth"
    for fields, message in [
        (RowFields(prompt="question"), f"prompt_key='question' is not a field of {path}"),
        (RowFields(answer="solution"), f"answer_key='solution' is not a field of {path}"),
        (RowFields(system="system"), f"system_key='system' is not a field of {path}"),
    ]:
        with pytest.raises(ValueError) as err:
            load_math_dataset(path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS, fields=fields)
        assert str(err.value) == f"{message}; its fields: {have}"
    # The defaults find `problem` and `reward_model.ground_truth`.
    examples, _ = load_math_dataset(path, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert [(ex.index, ex.answer) for ex in examples] == [(0, "3"), (1, "3"), (2, "3")]
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"text": "x", "answer": "1"}) + "\n")
    with pytest.raises(
        ValueError, match=r"none of the default prompt fields .* fields: answer, text"
    ):
        load_math_dataset(bare, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    bare.write_text(json.dumps({"question": "x", "solution": "1"}) + "\n")
    with pytest.raises(ValueError) as err:
        load_math_dataset(bare, tok, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert str(err.value) == (
        f"{bare} has none of the default answer fields ['reward_model.ground_truth', 'answer'] "
        "(set answer_key); its fields: question, solution"
    )


def test_datasets_directory_reads_shards_in_order(tmp_path, tok):
    """A save_to_disk directory loads as the same rows as the parquet file of its table; a
    DatasetDict root or a directory of something else is one error naming the path."""
    rows = [{"prompt": msgs(f"what is {i}+1?"), "answer": str(i + 1)} for i in range(5)]
    rows[3]["prompt"] = []  # malformed: an empty message list
    table = pa.Table.from_pylist(rows)
    write_hf_dataset(tmp_path / "ds" / "train", table, shards=3)
    (tmp_path / "ds" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    pq.write_table(table, tmp_path / "same.parquet")
    got, report = load_math_dataset(tmp_path / "ds" / "train", tok, max_prompt_tokens=64)
    want, _ = load_math_dataset(tmp_path / "same.parquet", tok, max_prompt_tokens=64)
    assert [(e.index, e.prompt, e.answer) for e in got] == [
        (e.index, e.prompt, e.answer) for e in want
    ]
    assert [e.index for e in got] == [0, 1, 2, 4] and report.malformed_indices == [3]
    with pytest.raises(ValueError, match=r"is a DatasetDict; give one split's directory: .*/train"):
        load_math_dataset(tmp_path / "ds", tok, max_prompt_tokens=64)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="without state.json"):
        load_math_dataset(tmp_path / "other", tok, max_prompt_tokens=64)
