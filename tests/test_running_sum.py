"""The running-sum task (e004): determinism, split, lengths, entropy, reward, tokenizer, config."""

import collections
import dataclasses

import numpy as np
import pytest

from dvp_jax import tokenizers
from dvp_jax.data import rewards
from dvp_jax.data import running_sum as rs
from dvp_jax.data.running_sum import RunningSumTask
from dvp_jax.data.tasks import ArithmeticTask, GeneratedTask
from dvp_jax.tokenizers import WordTokenizer, load_tokenizer
from dvp_jax.train import config as config_lib
from dvp_jax.train import resume
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.sections import DataConfig, task_knobs

N = 1000  # examples for the length and entropy figures


@pytest.fixture(scope="module")
def examples():
    return RunningSumTask().train_examples(N)


def _parse(ex):
    """(operands, [(operand, total) per step], thought words, final answer) of an example."""
    prompt = ex.prompt.split()
    assert prompt[0] == rs.PROMPT_WORD and prompt[-1] == "="
    operands = [int(x) for x in prompt[1:-1]]
    words = ex.target.split()
    assert words[-2] == rs.ANSWER_MARKER
    steps, thoughts, i = [], [], 0
    while i < len(words) - 2:
        if words[i] == "+":
            assert words[i + 2] == "="
            steps.append((int(words[i + 1]), int(words[i + 3])))
            i += 4
        else:
            thoughts.append(words[i])
            i += 1
    return operands, steps, thoughts, int(words[-1])


def test_deterministic_from_seed():
    a, b = RunningSumTask(seed=3), RunningSumTask(seed=3)
    assert a.train_examples(40) == b.train_examples(40)
    assert a.heldout_examples(30) == b.heldout_examples(30)
    assert a.train_example(17) == a.train_examples(1, start=17)[0]  # Random access.
    assert a.train_examples(40) != RunningSumTask(seed=4).train_examples(40)
    assert a.train_examples(40) != a.train_examples(40, stream=1)
    assert isinstance(a, GeneratedTask) and isinstance(ArithmeticTask(), GeneratedTask)


def test_reference_response_is_a_correct_running_sum(examples):
    task = RunningSumTask()
    for ex in examples[:300] + task.heldout_examples(100):
        operands, steps, thoughts, answer = _parse(ex)
        assert 4 <= len(operands) <= 8 and all(1 <= x <= 99 for x in operands)
        assert [x for x, _ in steps] == operands
        assert [t for _, t in steps] == np.cumsum(operands).tolist()
        assert answer == sum(operands) == int(ex.answer)
        assert ex.key == "+".join(map(str, operands))
        assert all(w.isalpha() and w.islower() for w in thoughts)


def test_response_lengths_in_band(examples):
    lengths = np.array([len(ex.target.split()) for ex in examples])
    assert lengths.min() >= 150 and lengths.max() <= 250
    # Uniform on [150, 250]: mean 200, std 29; the mean of 1,000 has std 0.9, so +-5 is > 5 sigma.
    assert abs(lengths.mean() - 200) < 5
    assert np.percentile(lengths, 5) < 165 and np.percentile(lengths, 95) > 235
    # The band holds for every operand count (thoughts absorb the difference).
    short = RunningSumTask(min_operands=1, max_operands=2, min_response_len=10, max_response_len=12)
    assert {len(ex.target.split()) for ex in short.train_examples(200)} == {10, 11, 12}


def test_thought_entropy_is_the_zipf_law(examples):
    words = [w for ex in examples for w in _parse(ex)[2]]
    counts = collections.Counter(words)
    freq = np.array(list(counts.values()), np.float64) / len(words)
    empirical = float(-(freq * np.log(freq)).sum())
    analytic = rs.zipf_entropy(2000, 1.1)
    # ~174,000 draws over 2,000 words: the plug-in estimate is low by ~(K - 1) / 2N = 0.006 nats.
    assert analytic > 4.5 and abs(empirical - analytic) < 0.05
    # The frequency of rank 1 is p1 = 0.169 (binomial std 0.001 here).
    assert abs(counts[rs.thought_words(1)[0]] / len(words) - rs.zipf_probs(2000, 1.1)[0]) < 0.01
    assert len(counts) > 1500  # The tail is sampled: most of the 2,000 words occur.
    assert rs.zipf_entropy(2000, 0.0) == pytest.approx(np.log(2000))  # Exponent 0: uniform.


@pytest.mark.parametrize("seeds", [(0, 0), (0, 1)])
def test_split_never_overlaps(seeds):
    # Small operands so problems repeat and the split is actually tested.
    small = dict(min_operands=2, max_operands=3, max_operand=9, min_response_len=20)
    train_task = RunningSumTask(seed=seeds[0], **small)
    held_task = RunningSumTask(seed=seeds[1], **small)
    heldout = {ex.key for ex in held_task.heldout_examples(60)}
    train = {ex.key for s in (0, 1) for ex in train_task.train_examples(1500, stream=s)}
    assert len(heldout) == 60 and len(train) > 500
    assert not heldout & train
    assert all(held_task.is_heldout(k) for k in heldout)
    assert not any(held_task.is_heldout(k) for k in train)


def test_heldout_fraction_and_exhaustion():
    keys = [f"{a}+{b}" for a in range(100) for b in range(100)]
    task = RunningSumTask()
    assert 0.08 < sum(map(task.is_heldout, keys)) / len(keys) < 0.12  # heldout_fraction 0.1
    tiny = RunningSumTask(min_operands=1, max_operands=1, max_operand=5, min_response_len=6)
    with pytest.raises(ValueError, match="distinct held-out problems"):
        tiny.heldout_examples(7)  # 6 problems exist in all.


def test_reward_reference_one_corrupted_zero(examples):
    exs = examples[:50]
    answers = [ex.answer for ex in exs]
    r = rewards.compute_rewards("marked_answer", [ex.target for ex in exs], answers)
    np.testing.assert_array_equal(r, np.ones(50, np.float32))
    off_by_one = [ex.target.rsplit(" ", 1)[0] + f" {int(ex.answer) + 1}" for ex in exs]
    no_marker = [ex.target.replace(rs.ANSWER_MARKER, "") for ex in exs]
    truncated = [" ".join(ex.target.split()[:-2]) for ex in exs]  # cut before the marker
    for corrupted in (off_by_one, no_marker, truncated):
        assert rewards.compute_rewards("marked_answer", corrupted, answers).sum() == 0
    # The exact-match verifier of the arithmetic task would not read these responses.
    assert rewards.compute_rewards("exact_match", [exs[0].target], answers[:1])[0] == 0


def test_tokenizer_round_trip_on_task_texts(examples):
    tok = load_tokenizer("running_sum")
    assert tokenizers.RUNNING_SUM == rs.TOKENIZER_NAME  # the spec both sides parse
    assert tok.vocab_size == 4 + len(rs.vocabulary(2000)) == 3008
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and tok.add_bos
    assert tok.stop_tokens == {0, 2}
    held = RunningSumTask().heldout_examples(50)
    for ex in examples[:200] + held:
        prompt, target = tok.encode_ids(ex.prompt), tok.encode_ids(ex.target)
        assert len(prompt) == len(ex.prompt.split()) and len(target) == len(ex.target.split())
        assert tok.encode_ids(ex.prompt + " " + ex.target) == prompt + target  # word-level
        assert tok.decode(target + [tok.eos_id, tok.pad_id]) == ex.target
        padded, n = tok.encode(ex.prompt, jax_padding=False)
        assert n == len(prompt) + 1 <= 11 and padded[0] == tok.bos_id
    ids = tok.encode_ids(examples[0].target)
    assert min(ids) >= 4 and max(ids) < tok.vocab_size  # no special, no <unk>
    # A spec names the word count; the vocabulary grows with it, the first ids stay.
    big = load_tokenizer("running_sum:4000")
    assert big.vocab_size == 5008 and big.encode_ids(examples[0].target) == ids
    with pytest.raises(ValueError, match="'zzz'"):
        tok.encode_ids("sum 3 zzz =")
    with pytest.raises(ValueError, match="running_sum:<n_words>"):
        load_tokenizer("running_sum:many")
    with pytest.raises(ValueError, match="distinct"):
        WordTokenizer(["a", "a"])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_operands": 5, "max_operands": 4}, "min_operands"),
        ({"min_operand": 9, "max_operand": 2}, "max_operand"),
        ({"max_operand": 200}, "max_operand"),  # 8 * 200 > 999
        ({"n_words": 0}, "n_words"),
        ({"zipf_exponent": float("nan")}, "zipf_exponent"),
        ({"min_response_len": 20}, "min_response_len"),  # < 4 * 8 + 2
        ({"min_response_len": 200, "max_response_len": 190}, "max_response_len"),
        ({"heldout_fraction": 1.0}, "heldout_fraction"),
    ],
)
def test_task_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RunningSumTask(**kwargs)


RS = {"task": "running_sum", "tokenizer": "running_sum"}


def _rs(**knobs):
    return {**RS, "running_sum": knobs}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        # The task's own checks, reported under the section that set the knob.
        (_rs(max_operands=3), "data.running_sum: .*min_operands <= max_operands"),
        (_rs(max_operand=150), "data.running_sum: .*max_operand"),  # 8 * 150 > 999
        (_rs(min_operand=-1), "data.running_sum: .*min_operand"),
        (_rs(n_words=0), "data.running_sum: .*n_words"),
        (_rs(zipf_exponent=-1.0), "data.running_sum: .*zipf_exponent"),
        (_rs(min_response_len=30), "data.running_sum: .*min_response_len"),
        (_rs(max_response_len=100), "data.running_sum: .*max_response_len"),
        (_rs(thought_words=10), "data.running_sum has unknown fields \\['thought_words'\\]"),
        ({"arithmetic": {"num_operands": 1}}, "data.arithmetic: .*min_operands"),
        # The data config's own cross-field checks.
        ({**RS, "max_prompt_len": 10}, "data.max_prompt_len must be"),
        ({**RS, "tokenizer": "char"}, "data.tokenizer must be"),
        (_rs(n_words=4000), "data.tokenizer must be"),  # needs 'running_sum:4000'
        ({"task": "arithmetic", "tokenizer": "running_sum"}, "data.tokenizer must be"),
        ({"task": "sum"}, "data.task must be"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"config.{field}"):
        DataConfig(**kwargs)


def test_config_makes_the_task_and_checks_decode_length():
    data = DataConfig(**{**_rs(n_words=4000), "tokenizer": "running_sum:4000", "seed": 2})
    task = data.make_task()
    assert task == RunningSumTask(seed=2, n_words=4000)
    assert data.running_sum == {**task_knobs(RunningSumTask), "n_words": 4000}
    assert load_tokenizer(data.tokenizer).vocab_size == 5008 and data.reward_spec == "marked_answer"
    assert DataConfig().make_task() == ArithmeticTask()
    assert DataConfig(task="math", path="x.jsonl").make_task() is None
    assert [DataConfig(task=t, path="p").reward_spec for t in ("arithmetic", "math")] == [
        "exact_match",
        "math_verify",
    ]

    cd = config_lib.default_config("rloo")
    cd.data.task, cd.data.tokenizer = "running_sum", "running_sum"
    assert cd.data.running_sum.to_dict() == task_knobs(RunningSumTask)
    with pytest.raises(
        ValueError, match="config.rollout.max_decode_length must be >= .*max_response_len .* 251"
    ):
        ExperimentConfig.from_config_dict(cd, 3008)
    cd.rollout.max_decode_length = 251
    cd.data.running_sum.max_operands = 6
    cfg = ExperimentConfig.from_config_dict(cd, 3008)
    assert cfg.data.make_task() == RunningSumTask(max_operands=6)
    cd.lock()
    with pytest.raises(AttributeError):  # a misspelt knob fails where it is set
        cd.data.running_sum.max_operandz = 3


def test_resume_ignores_new_fields_at_their_default():
    """A workdir made before a task knob existed resumes; a changed value does not."""
    cfg = ExperimentConfig.from_config_dict(config_lib.default_config("rloo"), 59)
    saved = {k: v for k, v in resume.flat_fields(cfg).items() if not k.startswith("data.running")}
    assert "data.arithmetic.num_operands" in saved
    assert resume.resume_mismatch(saved, cfg) == []
    knobs = {**cfg.data.running_sum, "max_operands": 6}
    changed = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, running_sum=knobs))
    assert resume.resume_mismatch(saved, changed) == [
        "data.running_sum.max_operands: new since the workdir was written, now 6 "
        "(pass --config.data.running_sum.max_operands=8 to resume it)"
    ]
    saved["data.running_sum.max_operands"] = 8
    assert resume.resume_mismatch(saved, changed) == [
        "data.running_sum.max_operands: workdir 8, now 6"
    ]


def test_default_config_takes_sections_and_names_a_misspelt_field():
    cd = config_lib.default_config("rloo", data=dict(running_sum=dict(max_operands=6)))
    assert cd.data.running_sum.max_operands == 6 and cd.data.running_sum.min_operands == 4
    assert cd.train.steps == 20 and cd.method == "rloo"
    with pytest.raises(KeyError, match="stepz"):
        config_lib.default_config(train=dict(stepz=3))
    with pytest.raises(TypeError, match="steps"):
        config_lib.default_config(train=dict(steps="many"))
