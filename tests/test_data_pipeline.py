"""Grain prompt pipeline and supervised warm-up batches on the generated task."""

import json

import numpy as np
import pytest

from dvp_jax.data import pipeline
from dvp_jax.data.tasks import ArithmeticTask, Example
from dvp_jax.tokenizers import CharTokenizer

TOK = CharTokenizer()
MAX_LEN = 16


def make(source=None, **kwargs):
    kwargs = {
        "batch_size": 4,
        "max_prompt_len": MAX_LEN,
        "process_index": 0,
        "process_count": 1,
        **kwargs,
    }
    return pipeline.make_prompt_iterator(source or ArithmeticTask(), TOK, **kwargs)


def test_batches_shapes_and_content():
    b = next(make())
    assert b.tokens.shape == (4, MAX_LEN) and b.tokens.dtype == np.int32
    assert b.lengths.dtype == np.int32 and len(b.prompts) == len(b.answers) == 4
    for row, n, prompt, answer in zip(b.tokens, b.lengths, b.prompts, b.answers, strict=True):
        assert row[0] == TOK.bos_id and (row[n:] == TOK.pad_id).all()
        assert TOK.decode(row[:n]) == prompt and prompt.endswith("=")
        assert int(answer) == eval(prompt[:-1])  # noqa: S307 - digits and + - only.
    with pytest.raises(ValueError, match="max_prompt_len=3"):
        next(make(max_prompt_len=3))


def test_deterministic_from_seed():
    a = [next(it).indices for it in [make(seed=1)] for _ in range(3)]
    b = [next(it).indices for it in [make(seed=1)] for _ in range(3)]
    c = [next(it).indices for it in [make(seed=2)] for _ in range(3)]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("source", ["task", "examples"])
def test_state_save_restore_continues_identically(source):
    src = ArithmeticTask() if source == "task" else ArithmeticTask().train_examples(10)
    it = make(src, num_epochs=None)
    for _ in range(4):  # Past one epoch of the 10-example list.
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # Round trip through JSON.
    expected = [next(it) for _ in range(5)]
    fresh = make(src, num_epochs=None)
    fresh.set_state(state)
    for want, got in zip(expected, [next(fresh) for _ in range(5)], strict=True):
        np.testing.assert_array_equal(want.tokens, got.tokens)
        np.testing.assert_array_equal(want.indices, got.indices)
        assert want.answers == got.answers
    with pytest.raises(ValueError, match="batch_size: saved 4 vs now 8"):
        make(src, batch_size=8).set_state(state)


def test_hosts_split_each_global_batch_of_one_process():
    # 3 hosts x 2 prompts read, at every step, exactly the rows of the one-process batch of 6
    # (in host order), for a list of examples over finite epochs and for the generated task.
    examples = [Example(prompt=f"{i}+0=", answer=str(i), index=i) for i in range(24)]
    for source, kw in [(examples, {"num_epochs": 2}), (None, {})]:
        args = (source,) if source is not None else ()
        one = make(*args, batch_size=6, process_index=0, process_count=1, **kw)
        hosts = [
            make(*args, batch_size=2, process_index=h, process_count=3, **kw) for h in range(3)
        ]
        steps = 8 if source is not None else 5  # 2 epochs of 24 = 8 global batches of 6
        for _ in range(steps):
            want = next(one)
            got = [next(h) for h in hosts]
            np.testing.assert_array_equal(np.concatenate([g.indices for g in got]), want.indices)
            np.testing.assert_array_equal(np.concatenate([g.tokens for g in got]), want.tokens)
        if source is not None:  # every host ends after the same number of batches
            for it in [one, *hosts]:
                with pytest.raises(StopIteration):
                    next(it)
    # Within one epoch the hosts' rows are disjoint and cover the examples.
    seen = [
        [
            int(i)
            for b in make(examples, batch_size=2, num_epochs=1, process_index=h, process_count=3)
            for i in b.indices
        ]
        for h in range(3)
    ]
    assert all(len(s) == 8 for s in seen)
    assert sorted(sum(seen, [])) == list(range(24))


def test_finite_epochs_end():
    examples = ArithmeticTask().train_examples(9)
    batches = list(make(examples, num_epochs=2, batch_size=4))
    assert len(batches) == 4  # 18 items, drop_remainder.
    first_epoch = [int(i) for b in batches[:2] for i in b.indices]
    assert len(set(first_epoch)) == 8  # The first 8 items are 8 distinct examples of epoch 1.


def test_sft_batch_layout():
    ex = [Example("3+4=", "7"), Example("12+34=", "46")]
    b = pipeline.sft_batch(ex, TOK, max_len=10)
    bos, eos, pad = TOK.bos_id, TOK.eos_id, TOK.pad_id
    expected0 = [bos] + TOK.encode_ids("3+4=7") + [eos] + [pad] * 3
    np.testing.assert_array_equal(b.tokens[0], expected0)
    np.testing.assert_array_equal(b.loss_mask[0], [0, 0, 0, 0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(b.loss_mask[1], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(b.lengths, [7, 10])
    np.testing.assert_array_equal(b.prompt_lengths, [5, 7])
    assert b.tokens.shape == b.loss_mask.shape == (2, 10) and b.loss_mask.dtype == np.float32
    with pytest.raises(ValueError, match="max_len=9"):
        pipeline.sft_batch(ex, TOK, max_len=9)


def test_sft_batch_for_step_deterministic_and_sharded():
    task = ArithmeticTask()
    kw = {"batch_size": 8, "max_len": 12}
    a = pipeline.sft_batch_for_step(task, TOK, step=3, process_index=0, process_count=1, **kw)
    b = pipeline.sft_batch_for_step(task, TOK, step=3, process_index=0, process_count=1, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # Two hosts at step s together cover the single-host batches of steps 2s and 2s + 1.
    h0 = pipeline.sft_batch_for_step(task, TOK, step=1, process_index=0, process_count=2, **kw)
    h1 = pipeline.sft_batch_for_step(task, TOK, step=1, process_index=1, process_count=2, **kw)
    s2 = pipeline.sft_batch_for_step(task, TOK, step=2, process_index=0, process_count=1, **kw)
    s3 = pipeline.sft_batch_for_step(task, TOK, step=3, process_index=0, process_count=1, **kw)
    np.testing.assert_array_equal(
        np.concatenate([h0.tokens, h1.tokens]), np.concatenate([s2.tokens, s3.tokens])
    )
    assert not np.array_equal(h0.tokens, h1.tokens)
