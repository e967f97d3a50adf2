"""Weighted reward terms: parsing `data.rewards`, exact weighted totals, failing user functions
scored 0 and counted, one-line errors for bad specs, and the per-term metrics of a real run."""

import logging
import math
import textwrap

import numpy as np
import pytest

from dvp_jax import metrics as metrics_lib
from dvp_jax.data import rewards
from dvp_jax.rollout.offline import RolloutBatch
from dvp_jax.tokenizers import CharTokenizer
from dvp_jax.train import evaluation
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.sections import DataConfig
from tests.train_utils import tiny_config_dict

# A user module the tests put on sys.path: each function has the `fn(response, answer)` form.
_USER_MODULE = """
    def length_tenths(response, answer):
        return len(response) / 10

    def boom(response, answer):
        raise RuntimeError("user reward exploded")

    def nan(response, answer):
        return float("nan")

    def picky(response, answer):  # fails on some responses only, in three ways
        if response == "raise":
            raise ValueError("picky")
        if response == "text":
            return "1.0"
        if response == "inf":
            return math.inf
        return 2.0

    class Holder:
        @staticmethod
        def nested(response, answer):
            return 3.0

    not_callable = 3.0
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `my_user_rewards` in tmp_path, on sys.path; also a module that fails to import."""
    (tmp_path / "my_user_rewards.py").write_text("import math\n" + textwrap.dedent(_USER_MODULE))
    (tmp_path / "broken_user_rewards.py").write_text("import no_such_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_user_rewards

    return my_user_rewards


def _names_weights(terms):
    return [(t.name, t.weight, t.on_length) for t in terms]


def test_parse_weights_defaults_and_user_functions(user_module):
    assert _names_weights(rewards.parse_rewards("math_verify")) == [("math_verify", 1.0, False)]
    spec = (
        " exact_match = 2 ,integer_format=0.1, truncated=-0.5,soft_overlong(3),"
        "my_user_rewards:length_tenths=0.5, my_user_rewards : Holder.nested"
    )
    terms = rewards.parse_rewards(spec)
    assert _names_weights(terms) == [
        ("exact_match", 2.0, False),
        ("integer_format", 0.1, False),
        ("truncated", -0.5, True),
        ("soft_overlong", 1.0, True),
        ("my_user_rewards.length_tenths", 0.5, False),
        ("my_user_rewards.Holder.nested", 1.0, False),
    ]
    assert terms[0].fn is rewards.exact_match_reward
    assert terms[4].fn is user_module.length_tenths
    assert terms[3].fn.keywords == {"buffer": 3}
    for t in terms:
        metrics_lib.declared(f"reward/{t.name}")
        metrics_lib.declared(f"reward_failures/{t.name}")

    # The config field: "" keeps each task's reward; a spec is parsed (and imported) there.
    assert [DataConfig(task=t, path="p").reward_spec for t in ("arithmetic", "math")] == [
        "exact_match",
        "math_verify",
    ]
    assert _names_weights(DataConfig().reward_terms) == [("exact_match", 1.0, False)]
    data = DataConfig(task="math", path="p", rewards="math_verify,my_user_rewards:nan=0.5")
    assert data.reward_spec == data.rewards and data.reward_terms[1].fn is user_module.nan


def test_format_and_length_rewards():
    fmt = rewards.math_format_reward
    assert [fmt(s, "") for s in ("so \\boxed{1/2}.", "\\boxed{\\frac{1}{2}}", "x\nAnswer: 34")] == [
        1.0,
        1.0,
        1.0,
    ]
    assert [fmt(s, "") for s in ("\\boxed{ }", "\\boxed{\\frac{1}{2}", "answer: 3", "Answer:")] == [
        0.0,
        0.0,
        0.0,
        0.0,
    ]
    assert fmt("\\boxed{} then \\boxed{7}", "") == 1.0
    assert [rewards.marked_format_reward(s, "9") for s in ("a <ans> 12", "<ans> 1 2", "12")] == [
        1.0,
        0.0,
        0.0,
    ]
    assert [rewards.integer_format_reward(s, "9") for s in ("12 x", " -3", "x12")] == [1, 1, 0]
    lengths, finished = np.array([1, 8, 9, 10, 10]), np.array([1, 1, 1, 1, 0], bool)
    # DAPO: L_max = 10, buffer 2 (default 10 // 5): 0 up to 8, then -1/2 per token.
    np.testing.assert_array_equal(
        rewards.soft_overlong_penalty(lengths, finished, 10), [0, 0, -0.5, -1, -1]
    )
    np.testing.assert_array_equal(
        rewards.soft_overlong_penalty(lengths, finished, 10, buffer=4), [0, -0.5, -0.75, -1, -1]
    )
    np.testing.assert_array_equal(rewards.truncated_penalty(lengths, finished, 10), [0] * 4 + [-1])


def test_weighted_total_is_exact():
    terms = rewards.parse_rewards(
        "exact_match=1.0,integer_format=0.25,truncated=0.5,soft_overlong(2)=2"
    )
    s = rewards.score(
        terms,
        ["12", "13", "x", "12"],
        ["12"] * 4,
        finished=np.array([True, True, True, False]),
        lengths=np.array([2, 3, 4, 4]),
        max_decode_length=4,
    )
    # Cut row 3: text terms 0. soft_overlong(2), L_max 4: lengths 2, 3, 4, 4 -> 0, -1/2, -1, -1.
    expect = {
        "exact_match": [1, 0, 0, 0],
        "integer_format": [1, 1, 0, 0],
        "truncated": [0, 0, 0, -1],
        "soft_overlong": [0, -0.5, -1, -1],
    }
    assert list(s.values) == list(expect)
    for name, v in expect.items():
        np.testing.assert_array_equal(s.values[name], np.asarray(v, np.float32))
    # 1 + 0.25 | 0.25 - 1 | -2 | -0.5 - 2
    np.testing.assert_array_equal(s.total, np.array([1.25, -0.75, -2.0, -2.5], np.float32))
    assert s.total.dtype == np.float32 and s.failures == dict.fromkeys(expect, 0)
    with pytest.raises(ValueError, match="soft_overlong needs max_decode_length"):
        rewards.score(terms, ["1"], ["1"], lengths=np.array([1]))


def test_failing_rewards_score_zero_and_are_counted(user_module, caplog):
    spec = "exact_match,my_user_rewards:boom=0.5,my_user_rewards:nan,my_user_rewards:picky=0.25"
    responses = ["7", "raise", "text", "inf", "7", "7", "7"]
    answers = ["7"] * 6 + ["1/2"]  # the last ground truth makes exact_match raise
    finished = np.array([True] * 6 + [True])
    finished[5] = False  # cut: no term is called on it, nothing fails there
    with caplog.at_level(logging.WARNING):
        s = rewards.score(rewards.parse_rewards(spec), responses, answers, finished=finished)
    assert s.failures == {
        "exact_match": 1,
        "my_user_rewards.boom": 6,
        "my_user_rewards.nan": 6,
        "my_user_rewards.picky": 3,
    }
    np.testing.assert_array_equal(s.values["exact_match"], [1, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(s.values["my_user_rewards.boom"], [0] * 7)
    np.testing.assert_array_equal(s.values["my_user_rewards.nan"], [0] * 7)
    np.testing.assert_array_equal(s.values["my_user_rewards.picky"], [2, 0, 0, 0, 2, 0, 2])
    np.testing.assert_array_equal(s.total, np.array([1.5, 0, 0, 0, 1.5, 0, 0.5], np.float32))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 4  # one line per failing term
    assert any("my_user_rewards.boom failed on 6 of 7" in w and "exploded" in w for w in warned)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("nope", "reward 'nope' is neither a built-in nor 'module:function'"),
        ("exact_match=abc", "reward 'exact_match': the weight must be a finite float, got 'abc'"),
        ("exact_match=nan", "the weight must be a finite float, got 'nan'"),
        ("exact_match,,integer_format", "has an empty term"),
        ("exact_match,exact_match=2", "reward 'exact_match' appears twice"),
        ("soft_overlong(0)", "the buffer must be an int >= 1"),
        ("truncated(3)", "reward 'truncated(3)' is neither a built-in"),
        (
            "no_such_module_xyz:fn",
            "module 'no_such_module_xyz' does not import (ModuleNotFoundError",
        ),
        ("broken_user_rewards:fn", "module 'broken_user_rewards' does not import"),
        ("my_user_rewards:missing", "module 'my_user_rewards' has no attribute 'missing'"),
        ("my_user_rewards:not_callable", "my_user_rewards.not_callable is not callable"),
        (":fn", "reward ':fn' is not 'module:function'"),
        (" ", "the reward spec is empty"),
    ],
)
def test_bad_specs_are_one_line_errors_before_any_work(user_module, spec, expected):
    cd = tiny_config_dict(**{"data.rewards": spec})
    with pytest.raises(ValueError) as error:
        ExperimentConfig.from_config_dict(cd, CharTokenizer().vocab_size)
    msg = str(error.value)
    assert msg.startswith("config.data.rewards: ") and "\n" not in msg
    assert expected in msg, msg
    assert "'math_verify'" in msg and "module:function" in msg  # the allowed names


def _rollout_batch(tok, responses, finished, prompt_len=3, max_decode_length=5):
    """A RolloutBatch of one prompt and these responses (`finished` ones end with EOS)."""
    n, t = len(responses), prompt_len + max_decode_length
    tokens = np.zeros((n, t), np.int32)
    lengths = np.zeros(n, np.int32)
    for i, (text, done) in enumerate(zip(responses, finished, strict=True)):
        ids = tok.encode_ids(text) + ([tok.eos_id] if done else [])
        assert len(ids) == max_decode_length or done
        tokens[i, :prompt_len] = [tok.bos_id] + tok.encode_ids("1+")
        tokens[i, prompt_len : prompt_len + len(ids)] = ids
        lengths[i] = len(ids)
    cols = np.arange(t)
    response = (cols >= prompt_len) & (cols < prompt_len + lengths[:, None])
    zeros = np.zeros((n, t), np.float32)
    return RolloutBatch(
        tokens=tokens,
        prompt_mask=cols < prompt_len + np.zeros((n, 1), int),
        response_mask=response,
        behaviour_logp=zeros,
        behaviour_logp_full=zeros,
        behaviour_pruned_mass=zeros,
        behaviour_safe_size=np.zeros((n, t), np.int32),
        prompt_index=np.zeros(n, np.int32),
        group_index=np.arange(n, dtype=np.int32),
        prompt_lengths=np.full(n, prompt_len, np.int32),
        response_lengths=lengths,
        finished=np.asarray(finished, bool),
    )


def test_rollout_rewards_and_trainer_metrics(user_module):
    """The trainer's reward path (`rollout_reward_terms` -> `reward_metrics`) on a rollout batch
    of tokens: stop tokens removed before scoring, a cut response 0 from text terms."""
    tok = CharTokenizer()
    batch = _rollout_batch(tok, ["12", "1", "123", "12345"], [True, True, True, False])
    answers = ["12"] * 4
    # The spec-string contract of `rollout_rewards` (one kind, as the evaluation passes it).
    np.testing.assert_array_equal(
        evaluation.rollout_rewards(tok, batch, answers, "exact_match"), [1, 0, 0, 0]
    )
    terms = DataConfig(rewards="exact_match,my_user_rewards:length_tenths=2,truncated").reward_terms
    scores = evaluation.rollout_reward_terms(tok, batch, answers, terms, max_decode_length=5)
    # length_tenths x 2: 0.4, 0.2, 0.6, 0 (cut); truncated: -1 on row 3.
    np.testing.assert_allclose(scores.total, [1.4, 0.2, 0.6, -1.0], rtol=1e-6)
    got = evaluation.reward_metrics(scores)
    metrics_lib.check(got)  # the names the trainer logs are declared
    assert got == pytest.approx(
        {
            "reward/exact_match": 0.25,
            "reward/my_user_rewards.length_tenths": 0.15,
            "reward/truncated": -0.25,
            "reward_failures/exact_match": 0,
            "reward_failures/my_user_rewards.length_tenths": 0,
            "reward_failures/truncated": 0,
        },
        rel=1e-6,
    )


def test_a_real_run_logs_each_reward_term(tiny_run):
    """Every RL row of the shared tiny run (default spec: the task's "exact_match" alone) has its
    term's mean, equal to `reward_mean` (weight 1), and no failures."""
    rl_rows = [r for r in tiny_run.rows() if "reward_mean" in r]
    assert rl_rows
    for row in rl_rows:
        assert row["reward/exact_match"] == pytest.approx(row["reward_mean"], abs=1e-6)
        assert row["reward_failures/exact_match"] == 0
        assert math.isfinite(row["reward/exact_match"])


def test_heldout_accuracy_is_scored_by_the_tasks_verifier_not_the_shaped_reward(tmp_path):
    """Shaping and penalty terms train the policy; held-out accuracy stays the answer check."""
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    own = dict(name="own", path=str(held))
    shaped = dict(name="shaped", path=str(held), reward="exact_match,truncated")
    cd = tiny_config_dict(
        **{
            "data.rewards": "exact_match=1,integer_format=0.5,truncated=2",
            "eval.sets": (own, shaped),
        }
    )
    cfg = ExperimentConfig.from_config_dict(cd, CharTokenizer().vocab_size)
    sets = evaluation.heldout_sets(cfg.data, cfg.eval, cfg.data.make_task(), CharTokenizer())
    assert [(s.name, s.reward) for s in sets] == [
        (evaluation.HELDOUT, "exact_match"),
        ("own", "exact_match"),
        ("shaped", "exact_match,truncated"),  # a set that names its reward keeps it
    ]
    assert cfg.data.reward_spec == "exact_match=1,integer_format=0.5,truncated=2"
