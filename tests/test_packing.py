"""Packed rows (`train/packing.py`) and the update on them (`step.rl_update`) against the padded
layout: the same loss, gradients and metrics, attention that never crosses a sequence, one
compiled program for every mix of lengths, and the zero-advantage skip."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dvp_jax.dvp import advantages as adv_lib
from dvp_jax.dvp.losses import LossConfig
from dvp_jax.sharding import Sharder
from dvp_jax.train import packing
from dvp_jax.train import step as step_lib
from dvp_jax.train.batch import abstract_batch, from_rollouts
from dvp_jax.train.state import init_train_state
from tests.helpers import tiny_model
from tests.train_utils import synthetic_rollouts

VOCAB = 64
# Eight sequences: prompts of 2-6 tokens, responses of 0-8 (one empty: left out by the packer,
# not counted by the metrics), T = 14 columns padded.
PROMPTS = [3, 2, 6, 4, 5, 2, 6, 3]
RESPONSES = [8, 1, 5, 0, 7, 3, 8, 2]
LONGEST = max(PROMPTS) + max(RESPONSES)
# Packed: rows of twice the longest sequence, 3 micro-batches of 2 rows, so sequences share rows
# and land in different micro-batches (the packer needs 3 of the 6 rows).
PACKED = packing.make_layout(
    sequences=8, longest=LONGEST, row_length=2 * LONGEST, micro_batches=3, packed=True
)
# Plain SGD with a large rate: the parameter change over LR is minus the gradient, to float32
# precision (with lr 1 the change of a parameter near 0.2 would keep only ~1e-8 of it).
LR = 1e6
SGD = optax.apply_if_finite(optax.sgd(LR), 10)


def _rollouts(seed=0, responses=RESPONSES):
    """Synthetic rollouts; rows 0 and 4 sampled as if the rollout under-rated their tokens
    (behaviour log-prob -7, far below the tiny model's ~-4), so their sequence ratio exp L
    passes MIS's cap and they are masked (E7)."""
    r = synthetic_rollouts(VOCAB, PROMPTS, responses, seed)
    low = np.zeros(len(PROMPTS), bool)
    low[[0, 4]] = True
    logp = np.where(low[:, None] & r.response_mask, -7.0, r.behaviour_logp).astype(np.float32)
    return dataclasses.replace(r, behaviour_logp=logp)


def _advantages(seed=0):
    return np.random.default_rng(seed + 100).normal(size=len(PROMPTS)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The packer
# ---------------------------------------------------------------------------------------------
def test_first_fit_decreasing_places_every_item_within_capacity_deterministically():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8]
    bins = packing.first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    # Longest first, each into the first bin with room; the equal 5s in index order.
    assert bins == [[2, 6], [7, 3], [0, 1], [4, 5]]
    assert packing.first_fit_decreasing(lengths, 10) == bins


@pytest.mark.parametrize("seed", range(5))
def test_the_layout_holds_any_mix_of_lengths(seed):
    """`make_layout`'s rows are enough for the worst mix (ceil(n / floor(L / longest)))."""
    rng = np.random.default_rng(seed)
    longest, n = 20, 37
    for row_length in (20, 29, 40, 75):
        layout = packing.make_layout(
            sequences=n, longest=longest, row_length=row_length, micro_batches=4, packed=True
        )
        assert layout.rows % 4 == 0
        for _ in range(20):
            lengths = rng.integers(2, longest + 1, n)
            if rng.uniform() < 0.3:
                lengths[:] = longest  # every sequence at the cap
            assert len(packing.first_fit_decreasing(lengths, row_length)) <= layout.rows


def test_pack_lays_out_each_sequence_with_its_own_positions_and_segment():
    rollouts, advantages = _rollouts(), _advantages()
    batch = packing.pack(rollouts, advantages, PACKED)
    assert batch.tokens.shape == (PACKED.rows, PACKED.row_length)
    # The shapes the update is compiled for.
    got = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), batch)
    assert got == jax.tree.map(
        lambda x: (x.shape, x.dtype), abstract_batch(PACKED.rows, PACKED.row_length)
    )
    padded = from_rollouts(rollouts, advantages)
    found = 0
    for row in range(PACKED.rows):
        seg = batch.segment_ids[row]
        for k in range(1, seg.max() + 1):
            cols = np.flatnonzero(seg == k)
            assert np.array_equal(cols, np.arange(cols[0], cols[-1] + 1))  # contiguous
            n = cols.size
            np.testing.assert_array_equal(batch.positions[row, cols], np.arange(n))
            # Which rollout row it is: the one whose first n tokens these are.
            (i,) = [
                i
                for i in range(len(PROMPTS))
                if PROMPTS[i] + RESPONSES[i] == n
                and np.array_equal(rollouts.tokens[i, :n], batch.tokens[row, cols])
            ]
            targets = cols[:-1]
            for name in ("response_mask", "behaviour_logp", "behaviour_safe_size"):
                np.testing.assert_array_equal(
                    getattr(batch, name)[row, targets], getattr(padded, name)[i, : n - 1]
                )
            assert np.all(batch.advantages[row, targets] == advantages[i])
            found += 1
        # Segments are numbered 1, 2, ... left to right, padding (0) only at the end.
        nonzero = seg[seg > 0]
        assert np.all(np.diff(nonzero) >= 0) and np.all(seg[len(nonzero) :] == 0)
    assert found == 7  # the empty response has no target and is left out
    # The fullest rows fill micro-batch 0 first (rows 0, 3 of M = 3), then micro-batch 1.
    filled = (batch.segment_ids > 0).any(axis=1)
    assert filled.tolist() == [True, True, False, True, False, False]
    # One sequence per row (the padded layout): every sequence its own row.
    one = packing.make_layout(
        sequences=8, longest=LONGEST, row_length=0, micro_batches=2, packed=False
    )
    assert (packing.pack(rollouts, advantages, one).segment_ids.max(axis=1) <= 1).all()


def test_a_row_shorter_than_the_longest_sequence_is_refused_in_one_line():
    from dvp_jax.train.config import ExperimentConfig
    from tests.train_utils import tiny_config_dict

    with pytest.raises(ValueError) as e:
        ExperimentConfig.from_config_dict(tiny_config_dict(**{"train.row_length": 15}), 64)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("config.train.row_length=15 is shorter than the longest sequence")
    assert "16 + 4 = 20" in message  # max_prompt_len + max_decode_length of the test config


def test_skip_zero_advantage_is_refused_with_a_kl_or_entropy_term():
    from dvp_jax.train.config import ExperimentConfig
    from tests.train_utils import tiny_config_dict

    for term in ("loss.kl_coef", "loss.entropy_coef"):
        over = {"train.skip_zero_advantage": True, term: 0.1}
        with pytest.raises(ValueError, match="skip_zero_advantage=True needs loss.kl_coef = 0"):
            ExperimentConfig.from_config_dict(tiny_config_dict(**over), 64)


def test_zero_advantage_marks_groups_of_equal_rewards():
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    got = adv_lib.zero_advantage(rewards, 2)
    assert got.tolist() == [True, True, False, False, True, True, True, True]
    assert np.all(np.asarray(adv_lib.rloo(rewards, 2))[got] == 0.0)


# ---------------------------------------------------------------------------------------------
# The update on packed rows == on the padded layout
# ---------------------------------------------------------------------------------------------
# Spread logits (init_std 0.2): at this threshold rows 2 and 6 hold a sampled token outside
# the trainer's safe set (E5 excludes them), rows 0 and 4 stay and pass MIS's cap (`_rollouts`).
LOG_RHO = -5.0


@functools.cache
def _state():
    graphdef, state, _ = init_train_state(tiny_model(seed=4, init_std=0.2), SGD, 0, Sharder())
    return graphdef, state


def _update(cfg: LossConfig, layout: packing.Layout | None):
    """The jitted update on `layout`'s rows (None: `from_rollouts`' one response per row)."""
    graphdef, _ = _state()
    per_row = None if layout is None or not layout.packed else layout.sequences_per_row
    return jax.jit(
        functools.partial(
            step_lib.rl_update,
            graphdef=graphdef,
            optimizer=SGD,
            loss_cfg=cfg,
            chunk_size=16,
            micro_batches=1 if layout is None else layout.micro_batches,
            sequences_per_row=per_row,
        )
    )


def _logprobs(layout: packing.Layout | None):
    graphdef, _ = _state()
    per_row = None if layout is None or not layout.packed else layout.sequences_per_row
    return jax.jit(
        functools.partial(
            step_lib.batch_logprobs,
            graphdef=graphdef,
            log_rho=LOG_RHO,
            temperature=1.0,
            chunk_size=16,
            micro_batches=1 if layout is None else layout.micro_batches,
            sequences_per_row=per_row,
        )
    )


def _run(cfg: LossConfig, layout, rollouts, advantages, indices=None, old_params=None):
    """(metrics, gradient) of one update on `rollouts` laid out by `layout` (None: padded)."""
    if layout is None:
        keep = np.arange(rollouts.num_rows) if indices is None else np.asarray(indices)
        batch = jax.tree.map(lambda x: x[keep], from_rollouts(rollouts, advantages))
    else:
        batch = packing.pack(rollouts, advantages, layout, indices)
    if old_params is not None:  # the decoupled PPO's old policy, by the same layout's program
        old = _logprobs(layout)(
            old_params, step_lib.logprob_inputs(jax.tree.map(jnp.asarray, batch))
        )
        batch = dataclasses.replace(
            batch, old_logp=np.asarray(old.logp), old_in_safe=np.asarray(old.in_safe)
        )
    _, state = _state()
    new, metrics = _update(cfg, layout)(state, jax.tree.map(jnp.asarray, batch))
    grads = jax.tree.map(
        lambda a, b: (np.asarray(a) - np.asarray(b)) / LR, state.params, new.params
    )
    return jax.device_get(metrics), grads


METHODS = {
    "rloo": LossConfig.preset("rloo", log_rho=LOG_RHO),
    "tis": LossConfig.preset("tis", log_rho=LOG_RHO),
    "mis": LossConfig.preset("mis", log_rho=LOG_RHO),
    "dvp": LossConfig.preset("dvp", log_rho=LOG_RHO),
    "mis_dvp": LossConfig.preset("mis_dvp", log_rho=LOG_RHO),
    "mis_dvp_ppo": LossConfig.preset("mis_dvp", log_rho=LOG_RHO, ppo_clip_eps=0.2),
    # The rejection baselines (E7b), bands set so that rows 0 and 4 (ratio ~e^3) are rejected
    # or masked and the others kept: the per-response means are segment sums when packed.
    "icepop": LossConfig.preset("icepop", log_rho=LOG_RHO),
    "geo_rs": LossConfig.preset("geo_rs", log_rho=LOG_RHO, geo_lo=0.05, geo_hi=5.0),
    "k3_rs": LossConfig.preset("k3_rs", log_rho=LOG_RHO, k3_max=2.0),
    # Combined rules, worst-token, OPSM (E14-E16) and batch-normalised weights (E17): the batch
    # mean spans the micro-batches (the padded layout has one, the packed three).
    "skyrl_geo_tis": LossConfig.preset(
        "skyrl_geo_tis", log_rho=LOG_RHO, rejection="seq_mean_k1=0.05:5"
    ),
    "worst_k3": LossConfig.preset("rloo", log_rho=LOG_RHO, rejection="seq_max_k3=10"),
    "tis_batch_norm": LossConfig.preset("tis", log_rho=LOG_RHO, batch_normalise_weights=True),
    "verl_seq_is_rs_batch_norm": LossConfig.preset(
        "verl_seq_is_rs",
        log_rho=LOG_RHO,
        rejection="seq_sum_k1=0.005:150",
        batch_normalise_weights=True,
    ),
}


def _assert_same(a, b, what=""):
    """Two layouts' metrics and gradients: float32, 1e-5 relative (sums in another order: the
    per-response sums of packed rows are segment sums), 1e-6 absolute near 0 (relative to a
    gradient leaf's largest entry for the gradients)."""
    (ma, ga), (mb, gb) = a, b
    assert set(ma) == set(mb)
    for key in ma:
        np.testing.assert_allclose(mb[key], ma[key], rtol=1e-5, atol=1e-6, err_msg=what + key)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        scale = max(float(np.abs(x).max()), 1e-30)
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * scale, err_msg=what + "grad")


@pytest.mark.parametrize("method", list(METHODS))
def test_packed_update_equals_the_padded_update(method):
    """Loss, gradient and every logged metric of the update on packed rows (several sequences
    per row, over 2 of 3 micro-batches) equal the padded layout's (one response per row, one
    micro-batch), for each method and a decoupled PPO update (old policy: the params moved by
    noise, its log-probs by each layout's own forward)."""
    cfg = METHODS[method]
    rollouts, advantages = _rollouts(), _advantages()
    old = None
    if cfg.ppo_clip_eps is not None:
        _, state = _state()
        key = jax.random.key(7)
        old = jax.tree.map(
            lambda p: p + 0.02 * jax.random.normal(key, p.shape, p.dtype), state.params
        )
    padded = _run(cfg, None, rollouts, advantages, old_params=old)
    packed = _run(cfg, PACKED, rollouts, advantages, old_params=old)
    m = padded[0]
    # The case exercises what it is about: responses excluded (E5) / masked (MIS), grads > 0.
    assert float(m["grad_norm"]) > 0
    if cfg.pruning:
        assert 0 < float(m["frac_responses_excluded"]) < 1
    if cfg.correction in ("seq_mis", "seq_geo_rs", "seq_k3_rs"):
        assert 0 < float(m["frac_responses_masked"]) < 1
    if cfg.correction == "token_icepop":
        assert 0 < float(m["frac_tokens_masked"]) < 1
    for rule in cfg.rules:
        assert 0 < float(m["rejected/" + rule.kind]) < 1, rule.kind
    if cfg.batch_normalise_weights:  # the whole batch's weights average 1 (E17)
        np.testing.assert_allclose(m["is_weight_mean"], 1.0, rtol=1e-6)
    if cfg.ppo_clip_eps is not None:
        assert 0 < float(m["ppo_clip_frac"]) < 1
    _assert_same(padded, packed, method + ": ")


def test_skip_zero_advantage_equals_the_padded_update_over_the_other_responses():
    """With the zero-advantage groups left out (`zero_advantage`), the packed update equals the
    padded update over the remaining responses alone (the normaliser is theirs)."""
    cfg = METHODS["mis_dvp"]
    rollouts = _rollouts(seed=1)
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0], np.float32)  # G = 2
    advantages = np.asarray(adv_lib.rloo(rewards, 2))
    trained = np.flatnonzero(~adv_lib.zero_advantage(rewards, 2))
    assert trained.tolist() == [2, 3, 6, 7]
    padded = _run(cfg, None, rollouts, advantages, indices=trained)
    packed = _run(cfg, PACKED, rollouts, advantages, indices=trained)
    _assert_same(padded, packed, "skip: ")


def test_one_sequence_never_changes_another_in_the_same_row():
    """Changing every token of one packed sequence leaves the log-probs of the other sequences
    of its row unchanged (bit for bit: the same program, and attention never reads across a
    sequence), and changes its own."""
    rollouts, advantages = _rollouts(), _advantages()
    batch = packing.pack(rollouts, advantages, PACKED)
    row = int(np.argmax(batch.segment_ids.max(axis=1)))
    seg = batch.segment_ids[row]
    assert seg.max() >= 3  # a row of three sequences
    changed = batch.tokens.copy()
    first = seg == 1
    changed[row, first] = (changed[row, first] + 7) % VOCAB
    _, state = _state()
    fn = _logprobs(PACKED)
    inputs = lambda b: step_lib.logprob_inputs(jax.tree.map(jnp.asarray, b))
    before = np.asarray(fn(state.params, inputs(batch)).logp_full)
    after = np.asarray(
        fn(state.params, inputs(dataclasses.replace(batch, tokens=changed))).logp_full
    )
    target_seg = seg[1:]  # the target t + 1's sequence
    others = (target_seg > 1) & batch.response_mask[row]
    own = (target_seg == 1) & batch.response_mask[row]
    np.testing.assert_array_equal(after[row, others], before[row, others])
    assert others.any() and np.all(after[row, own] != before[row, own])
    np.testing.assert_array_equal(np.delete(after, row, 0), np.delete(before, row, 0))


def test_no_recompile_across_steps_of_different_length_mixes():
    """Three updates on three mixes of lengths (from all short to all at the cap) run one
    compiled program: the rows' shape is the layout's, whatever the lengths."""
    fn = _update(METHODS["dvp"], PACKED)
    _, state = _state()
    state = jax.tree.map(jnp.copy, state)  # the update donates it
    mixes = [[1] * 8, RESPONSES, [max(RESPONSES)] * 8]
    for i, responses in enumerate(mixes):
        batch = packing.pack(_rollouts(seed=i, responses=responses), _advantages(i), PACKED)
        state, metrics = fn(state, jax.tree.map(jnp.asarray, batch))
        assert np.isfinite(float(metrics["loss"]))
    assert fn._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# One builder for the run and the TPU compile
# ---------------------------------------------------------------------------------------------
def test_aot_compiles_the_programs_the_run_jits():
    """`dvp_jax.aot` builds the trainer's programs with the function the run uses
    (`programs.trainer_programs`): on this host's devices the update (with non-default Adam
    betas, which an optimizer built apart would lose), the PPO old policy's forward and the SFT
    step lower to the very programs the run's parts hold."""
    from dvp_jax.plan.specs import train_specs
    from dvp_jax.train.build import build_parts
    from dvp_jax.train.config import ExperimentConfig
    from tests.train_utils import tiny_config_dict

    over = {
        "train.b1": 0.8,
        "train.b2": 0.95,
        "train.updates_per_batch": 2,
        "loss.ppo_clip_eps": 0.2,
        "train.micro_batches": 2,
        "mesh.fsdp": 4,
        "mesh.tensor": 2,
    }
    cfg = ExperimentConfig.from_config_dict(tiny_config_dict(**over), VOCAB)
    parts, _ = build_parts(cfg)
    specs, _ = train_specs(cfg, jax.devices())
    by_name = {s.name: s for s in specs}
    assert set(by_name) == {"rl_update", "logprobs", "sft_step"}
    run = {"rl_update": parts.update, "logprobs": parts.logprobs, "sft_step": parts.sft_step}
    for name, spec in by_name.items():
        ours, theirs = run[name].lower(*spec.args), spec.jitted.lower(*spec.args)
        assert ours.as_text() == theirs.as_text(), name
    # The betas are in the update: 0.8 appears as Adam's first-moment decay.
    assert (
        "dense<8.000000e-01>"
        in by_name["rl_update"].jitted.lower(*by_name["rl_update"].args).as_text()
    )


# ---------------------------------------------------------------------------------------------
# The update's cost at real lengths
# ---------------------------------------------------------------------------------------------
def test_update_cost_follows_the_real_tokens():
    """`cost.update_costs` from a compiled update's counts (given here: dense 1 FLOP per row
    token, attention 1,000 per counted block pair; fp32 blockwise at 2,048-token rows of 512
    blocks, 4 micro-batches of 8 rows): at the cap packing saves nothing (every row full, every
    causal pair visited); at short lengths the rows, the micro-batches that run and the visited
    block pairs fall, and with them the FLOPs."""
    from dvp_jax.plan import update_cost as cost
    from dvp_jax.train.config import ExperimentConfig, default_config

    c = default_config("dvp")
    c.model.vocab_size = 512
    c.data.max_prompt_len, c.rollout.max_decode_length = 1024, 1024
    c.train.prompts_per_step, c.train.group_size, c.train.micro_batches = 8, 4, 4
    cfg = ExperimentConfig.from_config_dict(c, 512)
    rows, length, nb = 32, 2048, 4  # the compiled layout: 32 rows, blocks of 512
    flops = rows * length * 1.0 + rows * nb * nb * 1000.0
    price = lambda responses: cost.update_costs(
        cfg,
        np.full(32, 1024),
        np.asarray(responses),
        hosts=1,
        flops=flops,
        attention_flops=rows * nb * nb * 1000.0,
        peak_flops=6e12,  # one TFLOP/s at float32's 6 passes
    )
    padded, packed = price([1024] * 32)
    assert (padded.rows, padded.micro_batches) == (packed.rows, packed.micro_batches) == (32, 4)
    causal = 32 * nb * (nb + 1) // 2
    assert padded.tflop_per_chip == pytest.approx((32 * 2048 + causal * 1000) / 1e12)
    assert packed.tflop_per_chip == pytest.approx(padded.tflop_per_chip)
    assert padded.seconds_at_peak == pytest.approx(padded.tflop_per_chip)
    padded, packed = price([100] * 28 + [1024] * 4)  # 28 sequences of 1,124 tokens, 4 of 2,048
    assert (packed.rows, packed.micro_batches) == (32, 4)  # 1,124 + 1,124 > 2,048: one a row
    # Fewer block pairs: a 1,124-token row's last block is padding, never visited.
    assert packed.tflop_per_chip < padded.tflop_per_chip
    padded, packed = price([20] * 32)  # 1,044 tokens: still one per row (two make 2,088)
    assert packed.rows == 32
    short = cost.update_costs(
        cfg,
        np.full(32, 100),
        np.full(32, 20),
        hosts=1,
        flops=flops,
        attention_flops=rows * nb * nb * 1000.0,
        peak_flops=6e12,
    )
    padded, packed = short
    # 120-token sequences: 17 to a row (2,040 tokens), then 15 (1,800): 2 rows, one micro-batch
    # of 8 rows runs. Each row visits its 4 diagonal block pairs and the 3 (i, i - 1) pairs of
    # the sequences that cross the block edges at 512, 1,024 and 1,536.
    assert (packed.rows, packed.micro_batches) == (2, 1)
    assert packed.tflop_per_chip == pytest.approx((8 * 2048 + 2 * 7 * 1000) / 1e12)
    assert packed.tflop_per_chip < 0.2 * padded.tflop_per_chip
