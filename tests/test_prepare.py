"""`python -m dvp_jax.data.prepare` on small files with the public datasets' real column names
(DAPO-Math-17k, its open-r1 processed variant, AIME25 in two layouts): the output is the layout
the loader reads by default, duplicates and bad rows are counted."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dvp_jax.data import prepare
from dvp_jax.data.math_data import load_math_dataset, render_messages
from dvp_jax.tokenizers import HFTokenizer
from tests.test_data_math import write_hf_dataset

P = prepare.DAPO_PREFIX
S = prepare.DAPO_SUFFIX


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A word-level tokenizer trained here (no download); unknown words map to [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(
        ["solve the problem"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    t.save(str(path))
    return HFTokenizer(path, eos="</s>")


def dapo_row(problem: str, answer: str, index: str) -> dict:
    """One row of BytedTsinghua-SIA/DAPO-Math-17k (its columns and nesting)."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": P + problem + S, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def processed_row(problem: str, answer: str, index: str) -> dict:
    """One row of open-r1/DAPO-Math-17k-Processed: prompt = source_prompt[0].content, solution =
    reward_model.ground_truth (its create_dataset.py), plus the original columns."""
    row = dapo_row(problem, answer, index)
    return {
        "prompt": row["prompt"][0]["content"],
        "solution": answer,
        "data_source": row["data_source"],
        "source_prompt": row["prompt"],
        "ability": row["ability"],
        "reward_model": row["reward_model"],
        "extra_info": row["extra_info"],
    }


def test_dapo17k_repeats_are_dropped_and_bad_rows_counted(tmp_path, tok):
    rows = [dapo_row("What is 1+2?", "3", "a")] * 3 + [dapo_row("What is  2+2?", "4", "b")]
    rows.append({**dapo_row("No answer", "1", "c"), "reward_model": {"ground_truth": None}})
    rows.append(dapo_row("what is 2+2?", "4", "d"))  # the same problem as "b" (case, spaces)
    src = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out" / "train.parquet"
    counts = prepare.prepare([str(src)], "auto", str(out))
    assert counts == {"read": 6, "malformed": 1, "duplicates": 3, "written": 2}
    written = pq.read_table(out).to_pylist()
    assert written[0] == {
        **dapo_row("What is 1+2?", "3", "a"),
        "reward_model": {"ground_truth": "3", "style": "rule"},
    }
    examples, report = load_math_dataset(out, tok, max_prompt_tokens=512)  # default fields
    assert report.num_malformed == 0
    assert [ex.answer for ex in examples] == ["3", "4"]
    assert examples[1].prompt == render_messages(
        [{"role": "user", "content": P + "What is  2+2?" + S}]
    )


def test_processed_variant_and_a_datasets_directory(tmp_path, tok):
    rows = [processed_row(f"Problem {i}.", str(i), f"id{i}") for i in range(4)]
    table = pa.Table.from_pylist(rows)
    write_hf_dataset(tmp_path / "processed", table, shards=2)
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    out = tmp_path / "train.jsonl"
    for src in (tmp_path / "processed", tmp_path / "train-00000-of-00001.parquet"):
        counts = prepare.prepare([str(src)], "dapo17k_processed", str(out))
        assert counts == {"read": 4, "malformed": 0, "duplicates": 0, "written": 4}
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["reward_model"]["ground_truth"] for r in lines] == ["0", "1", "2", "3"]
        assert lines[2]["prompt"] == [{"content": P + "Problem 2." + S, "role": "user"}]
        assert lines[2]["extra_info"] == {"index": "id2"}
    # The original and the processed file hold the same problems: together, each once.
    pq.write_table(pa.Table.from_pylist([dapo_row("Problem 1.", "1", "x")]), tmp_path / "o.parquet")
    counts = prepare.prepare([str(tmp_path / "o.parquet"), str(src)], "auto", str(out))
    assert counts == {"read": 5, "malformed": 0, "duplicates": 1, "written": 4}


def test_aime25_layouts_get_the_dapo_instruction(tmp_path, tok):
    math_ai = tmp_path / "test.jsonl"  # math-ai/aime25: problem, answer, id
    math_ai.write_text(
        "".join(
            json.dumps({"problem": f"Find x{i}.", "answer": str(70 + i), "id": str(i)}) + "\n"
            for i in range(3)
        )
        + "not json\n"
    )
    opencompass = tmp_path / "aime2025-II.jsonl"  # opencompass/AIME2025: question, answer
    opencompass.write_text(json.dumps({"question": "Find y.", "answer": 588}) + "\n")
    out = tmp_path / "aime25.parquet"
    counts = prepare.prepare([str(math_ai), str(opencompass)], "aime25", str(out))
    assert counts == {"read": 5, "malformed": 1, "duplicates": 0, "written": 4}
    examples, _ = load_math_dataset(out, tok, max_prompt_tokens=512)
    assert [ex.answer for ex in examples] == ["70", "71", "72", "588"]
    user = [{"role": "user", "content": P + "Find y." + S}]
    assert examples[3].prompt == render_messages(user)
    prepare.prepare([str(opencompass)], "auto", str(out), template="none")
    assert pq.read_table(out).to_pylist()[0]["prompt"][0]["content"] == "Find y."


def test_bad_input_is_one_line_before_any_output(tmp_path):
    src = tmp_path / "aime.jsonl"
    src.write_text(json.dumps({"problem": "Find x.", "answer": "1"}) + "\n")
    out = tmp_path / "out.parquet"
    with pytest.raises(ValueError) as err:
        prepare.prepare([str(src)], "dapo17k", str(out))
    assert str(err.value) == (
        f"--input {src} lacks format dapo17k's columns prompt, reward_model; its columns: "
        "answer, problem"
    )
    with pytest.raises(ValueError, match="must end in .jsonl or .parquet"):
        prepare.prepare([str(src)], "auto", str(tmp_path / "out.csv"))
    assert not out.exists()
    # The command line: one line on stderr, exit 2; then a conversion as docs/data.md types it.
    cmd = [sys.executable, "-m", "dvp_jax.data.prepare", f"--input={src}", f"--out={out}"]
    bad = subprocess.run([*cmd, "--format=dapo17k"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr == f"error: {err.value}\n"
    good = subprocess.run([*cmd, "--format=aime25"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert f"wrote 1 rows to {out}" in good.stdout and "1 rows read, 0 malformed" in good.stdout
