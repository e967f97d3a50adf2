"""Math files (DAPO-Math layout): malformed rows are counted, reported by index and skipped."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dvp_jax.data import pipeline
from dvp_jax.data.tasks import load_math_dataset, render_messages
from dvp_jax.rollout.tokenizers import HFTokenizer

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
