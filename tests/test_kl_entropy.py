"""The KL-to-reference term (E11) and the entropy bonus (E12), both off by default.

Tolerances: loss values and metrics 1e-5 relative (fp32 vs the float64 loop reference; 1e-7
absolute for entries near 0); gradients in logp and in the entropy 1e-5 relative against the
reference's central finite differences (the terms are smooth and the step is 1e-6); the entropy's
own value 1e-5 and its gradient through the chunked pass 1e-4 (composed: matmul + softmax, fp32
accumulation over V), against float64 finite differences chained through h W exactly. The off
switches are checked as the same program (identical lowered text, bit-equal outputs).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dvp_jax.dvp import chunked, losses, pruning
from dvp_jax.dvp.losses import LossConfig, dvp_loss
from dvp_jax.sharding import Sharder
from dvp_jax.train import batch as batch_lib
from dvp_jax.train import step as step_lib
from dvp_jax.train.state import init_train_state, with_fresh_optimizer
from tests import reference as ref
from tests.helpers import tiny_model
from tests.shared_runs import tiny_trainer
from tests.train_utils import synthetic_batch


def _batch(seed, b=10, t=6, prune=True):
    """A loss batch with reference log-probs near the policy's (noise 0.5, so k3's tokens are
    far from the d^2/2 regime) and, under pruning, floors where y is outside either safe set."""
    rng = np.random.default_rng(seed)
    mask = np.arange(t)[None, :] < rng.integers(2, t + 1, size=b)[:, None]
    lr = -rng.exponential(1.0, size=(b, t))
    lp = lr + rng.normal(0.0, 0.3, size=(b, t))
    in_safe = rng.random((b, t)) > 0.05 if prune else np.ones((b, t), bool)
    ref_in_safe = rng.random((b, t)) > 0.15 if prune else np.ones((b, t), bool)
    ref_lp = np.where(ref_in_safe, lp + rng.normal(0.0, 0.5, size=(b, t)), pruning.LOGP_FLOOR)
    lp = np.where(in_safe, lp, pruning.LOGP_FLOOR)
    entropy = rng.uniform(0.1, 3.0, size=(b, t))
    f = lambda x: np.asarray(x, np.float32)
    return dict(
        lp=f(lp),
        lr=f(lr),
        adv=f(rng.normal(size=b)),
        mask=mask,
        in_safe=in_safe,
        ref_logp=f(ref_lp),
        ref_in_safe=ref_in_safe,
        entropy=f(entropy),
    )


def _value_and_grads(cfg, lp, lr, adv, mask, in_safe, ref_logp, ref_in_safe, entropy):
    def fn(lp, entropy):
        return dvp_loss(
            lp,
            lr,
            adv,
            mask,
            in_safe,
            cfg,
            ref_logp=ref_logp if cfg.uses_reference else None,
            ref_in_safe=ref_in_safe if cfg.uses_reference else None,
            entropy=entropy if cfg.entropy_coef > 0 else None,
        )

    (loss, metrics), grads = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(lp, entropy)
    return loss, metrics, grads


@functools.partial(jax.jit, static_argnames="cfgs")
def _many_losses_and_grads(cfgs, cases):
    """`_value_and_grads(cfg, *case)` for each pair, in one program: a grid of configs compiles
    as one program in a fraction of the time of one per config."""
    return [_value_and_grads(cfg, *case) for cfg, case in zip(cfgs, cases, strict=True)]


def _grid(cases: dict) -> dict:
    """{key: (loss, metrics, grads)} for `cases` {key: (cfg, args)}, all in one program."""
    keys = list(cases)
    out = _many_losses_and_grads(tuple(cases[k][0] for k in keys), [cases[k][1] for k in keys])
    return dict(zip(keys, out, strict=True))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value",
    [
        ("kl_coef", -0.1),
        ("kl_coef", math.nan),
        ("kl_estimator", "k2"),
        ("kl_reference_dtype", "float16"),
        ("entropy_coef", -1.0),
        ("entropy_coef", math.inf),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})


def test_off_by_default_and_inputs_must_match_the_config():
    cfg = LossConfig()
    assert (cfg.kl_coef, cfg.entropy_coef, cfg.uses_reference) == (0.0, 0.0, False)
    d = _batch(0)
    args = (d["lp"], d["lr"], d["adv"], d["mask"], d["in_safe"])
    with pytest.raises(ValueError, match="ref_logp"):
        dvp_loss(*args, cfg, ref_logp=d["ref_logp"], ref_in_safe=d["ref_in_safe"])
    with pytest.raises(ValueError, match="ref_logp"):
        dvp_loss(*args, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_in_safe"):  # pruning on: floors need a mask
        dvp_loss(*args, LossConfig(kl_coef=0.1), ref_logp=d["ref_logp"])
    with pytest.raises(ValueError, match="entropy"):
        dvp_loss(*args, cfg, entropy=d["entropy"])
    with pytest.raises(ValueError, match="entropy"):
        dvp_loss(*args, LossConfig(entropy_coef=0.1))


# ----------------------------------------------------------------------------- reference


REFERENCE_TERMS = [("none", "token_mean"), ("token_mis", "seq_mean_token_sum")]


@pytest.fixture(scope="module")
def reference_grid():
    """Every (estimator, prune, correction, normalisation) case of `test_matches_reference`."""
    cases = {}
    for estimator in losses.KL_ESTIMATORS:
        for prune in (True, False):
            for correction, normalisation in REFERENCE_TERMS:
                cfg = LossConfig(
                    prune=prune,
                    correction=correction,
                    normalisation=normalisation,
                    kl_coef=0.3,
                    kl_estimator=estimator,
                    entropy_coef=0.05,
                )
                key = (estimator, prune, correction, normalisation)
                cases[key] = (cfg, tuple(_batch(1, prune=prune).values()))
    return _grid(cases)


@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
@pytest.mark.parametrize("prune", [True, False])
@pytest.mark.parametrize("correction, normalisation", REFERENCE_TERMS)
def test_matches_reference(reference_grid, estimator, prune, correction, normalisation):
    d = _batch(1, prune=prune)
    kw = dict(prune=prune, correction=correction, normalisation=normalisation, cap=2.0)
    loss, metrics, (g_lp, g_h) = reference_grid[estimator, prune, correction, normalisation]
    extra = dict(kl_coef=0.3, kl_estimator=estimator, entropy_coef=0.05)
    extra |= {k: d[k] for k in ("ref_logp", "ref_in_safe", "entropy")}
    args = (d["lp"], d["lr"], d["adv"], d["mask"], d["in_safe"])
    expect = ref.dvp_loss(*args, **kw, **extra)
    z = expect["kept_tokens"] if normalisation == "token_mean" else expect["kept_responses"]
    assert 0 < z and metrics["kept_tokens"] == expect["kept_tokens"]
    np.testing.assert_allclose(loss, expect["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["kl_ref"], expect["kl_ref"], rtol=1e-5, atol=1e-7)
    # The two terms, each against the reference with only that term on.
    pg = ref.dvp_loss(*args, **kw)["loss"]
    kl_only = ref.dvp_loss(*args, **kw, **(extra | dict(entropy_coef=0.0)))["loss"]
    np.testing.assert_allclose(metrics["kl_ref_loss"], kl_only - pg, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        metrics["entropy_bonus"], expect["loss"] - kl_only, rtol=1e-5, atol=1e-7
    )
    assert metrics["entropy_bonus"] < 0 and (estimator == "k1" or metrics["kl_ref_loss"] > 0)
    # Gradients: in logp by finite differences of the reference; in the entropy -eta/Z on kept
    # tokens (0 elsewhere, also on excluded responses and masked tokens).
    np.testing.assert_allclose(
        g_lp, ref.loss_grad(d["lp"], *args[1:], **kw, **extra), rtol=1e-5, atol=1e-7
    )
    h_up = ref.dvp_loss(
        *args, **kw, **(extra | dict(entropy=d["entropy"].astype(np.float64) + 1.0))
    )["loss"]
    kept = np.abs(np.asarray(g_h)) > 0
    np.testing.assert_allclose(g_h[kept], -0.05 / z, rtol=1e-5)
    assert kept.sum() == expect["kept_tokens"]
    np.testing.assert_allclose(h_up - expect["loss"], -0.05 * kept.sum() / z, rtol=1e-9)
    if prune:  # the reference's safe set is exercised: some kept tokens are outside it
        assert 0 < metrics["frac_tokens_outside_ref_safe"] < 1
    else:
        assert "frac_tokens_outside_ref_safe" not in metrics


def test_with_decoupled_ppo_matches_reference():
    """The KL and entropy terms beside the PPO-clipped policy term (updates_per_batch > 1): not
    clipped, not weighted; the gradient is the reference surrogate's (1e-4: composed)."""
    d = _batch(4)
    old = np.where(d["in_safe"], d["lp"] + 0.05, pruning.LOGP_FLOOR).astype(np.float32)
    cfg = LossConfig(kl_coef=0.3, entropy_coef=0.05, ppo_clip_eps=0.2)

    def fn(lp):
        return dvp_loss(
            lp,
            d["lr"],
            d["adv"],
            d["mask"],
            d["in_safe"],
            cfg,
            old,
            d["in_safe"],
            ref_logp=d["ref_logp"],
            ref_in_safe=d["ref_in_safe"],
            entropy=d["entropy"],
        )

    (loss, metrics), g = jax.jit(jax.value_and_grad(fn, has_aux=True))(d["lp"])
    args = (d["lp"], d["lr"], d["adv"], d["mask"], d["in_safe"])
    kw = dict(prune=True, correction="none", ppo_eps=0.2, old_logp=old, old_in_safe=d["in_safe"])
    kw |= dict(kl_coef=0.3, entropy_coef=0.05)
    kw |= {k: d[k] for k in ("ref_logp", "ref_in_safe", "entropy")}
    np.testing.assert_allclose(g, ref.loss_grad(d["lp"], *args[1:], **kw), rtol=1e-4, atol=1e-7)
    expect = ref.dvp_loss(*args, **kw)
    np.testing.assert_allclose(metrics["kl_ref"], expect["kl_ref"], rtol=1e-5)
    assert metrics["kept_tokens"] == expect["kept_tokens"]


def test_k3_by_hand():
    """One response, 2 tokens, correction none, A = 0 (only the KL term), beta = 0.5, Z = 2.
    d = log pi_ref - log pi: token 0: -0.5 - (-1.0) = 0.5, k3 = e^0.5 - 0.5 - 1 = 0.1487213;
    token 1: -2.0 - (-1.0) = -1.0, k3 = e^-1 + 1 - 1 = 0.3678794.
    kl_ref = (0.1487213 + 0.3678794) / 2 = 0.2583003; loss = 0.5 * 0.5166007 / 2 = 0.1291502.
    d loss / d log pi_t = (beta / Z) (1 - e^d_t) = 0.25 (1 - 1.6487213) = -0.1621803 and
    0.25 (1 - 0.3678794) = 0.1580301. k1: kl_ref = (-0.5 + 1.0) / 2 = 0.25, gradient 0.25 each.
    """
    lp, lr = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.0, -1.0]])
    ref_lp, mask = jnp.array([[-0.5, -2.0]]), jnp.ones((1, 2), bool)
    cfg = LossConfig(kl_coef=0.5, kl_estimator="k3")
    args = (lp, lr, jnp.zeros(1), mask, mask, ref_lp, mask, jnp.zeros((1, 2)))
    results = _grid({"k3": (cfg, args), "k1": (dataclasses.replace(cfg, kl_estimator="k1"), args)})
    loss, metrics, (g, _) = results["k3"]
    np.testing.assert_allclose(metrics["kl_ref"], 0.2583003, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.1291502, rtol=1e-6)
    np.testing.assert_allclose(g, [[-0.1621803, 0.1580301]], rtol=1e-6)
    loss, metrics, (g, _) = results["k1"]
    np.testing.assert_allclose([metrics["kl_ref"], loss], [0.25, 0.125], rtol=1e-6)
    np.testing.assert_allclose(g, [[0.25, 0.25]], rtol=1e-6)


def test_equal_policies_give_zero_kl_and_the_policy_gradient():
    """pi = pi_ref: k1 = k3 = 0 exactly; k3's gradient is E9's (1 - e^0 = 0), k1's adds
    beta / Z on every kept token."""
    d = _batch(2)
    d["ref_logp"], d["ref_in_safe"] = d["lp"], d["in_safe"]
    args = tuple(d.values())
    results = _grid(
        {"base": (LossConfig(), args)}
        | {e: (LossConfig(kl_coef=0.2, kl_estimator=e), args) for e in ("k3", "k1")}
    )
    base = results["base"]
    for estimator, shift in [("k3", 0.0), ("k1", 1.0)]:
        loss, metrics, (g, _) = results[estimator]
        assert metrics["kl_ref"] == 0.0 and metrics["kl_ref_loss"] == 0.0
        np.testing.assert_array_equal(loss, base[0])
        kept = np.asarray(base[2][0]) != 0
        z = metrics["kept_tokens"]
        np.testing.assert_allclose(g, base[2][0] + shift * 0.2 / z * kept, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- entropy (E12)


def _entropy_inputs():
    rng = np.random.default_rng(3)
    h = rng.normal(size=(12, 8)).astype(np.float32)
    w = (1.5 * rng.normal(size=(8, 40))).astype(np.float32)
    return h, w, rng.integers(0, 40, size=12).astype(np.int32)


@pytest.mark.parametrize("log_rho", [-2.5, None])
def test_chunked_policy_entropy_value_and_gradient_match_reference(log_rho):
    """H(pi_S) (H(pi) unpruned) from the chunked pass, and d sum g H / d(h, W) through its custom
    VJP, against float64 finite differences in the logits chained through z = h W exactly."""
    h, w, y = _entropy_inputs()
    tau, g = 0.8, np.linspace(-1.0, 2.0, 12)
    rho = -math.inf if log_rho is None else log_rho

    def fn(h, w):
        _, stats = chunked.chunked_token_stats(
            h, w, y, log_rho=log_rho, temperature=tau, chunk_size=16, policy_entropy=True
        )
        return jnp.sum(g * stats.policy_entropy), stats

    (_, stats), (dh, dw) = jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(h, w)
    z = h.astype(np.float64) @ w.astype(np.float64)
    expect = [ref.pruned_entropy(row, rho, tau) for row in z]
    np.testing.assert_allclose(stats.policy_entropy, expect, rtol=1e-5, atol=1e-6)
    if log_rho is None:  # unpruned: the policy entropy is the diagnostic's H(pi)
        np.testing.assert_allclose(stats.policy_entropy, stats.entropy, rtol=1e-6)
    else:  # pruning changes it, and no logit sits within the finite-difference step of rho
        assert np.max(np.abs(stats.policy_entropy - stats.entropy)) > 1e-2
        gap = z / tau - (z / tau).max(-1, keepdims=True) - log_rho
        assert np.min(np.abs(gap)) > 1e-4
    g_z = ref.entropy_grad_logits(z, rho, tau, g)
    np.testing.assert_allclose(dh, g_z @ w.T, rtol=1e-4, atol=1e-4 * np.abs(g_z @ w.T).max())
    np.testing.assert_allclose(dw, h.T @ g_z, rtol=1e-4, atol=1e-4 * np.abs(h.T @ g_z).max())


def test_chunked_policy_entropy_on_the_vocabulary_parallel_mesh_equals_one_device():
    """Tensor-sharded W (V = 40 over 4 shards of 10 columns, chunks of 4: a ragged last chunk):
    values 1e-5, gradients 1e-5 of the largest entry (summation order only)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    h, w, y = _entropy_inputs()
    mesh = jax.make_mesh((1, 2, 4), ("data", "fsdp", "tensor"))
    placed = (
        jax.device_put(h, NamedSharding(mesh, P(("data", "fsdp"), None))),
        jax.device_put(w, NamedSharding(mesh, P("fsdp", "tensor"))),
    )
    ys = jax.device_put(y, NamedSharding(mesh, P(("data", "fsdp"))))

    def run(h, w, y, mesh):
        def fn(h, w):
            _, stats = chunked.chunked_token_stats(
                h, w, y, log_rho=-2.5, chunk_size=4, mesh=mesh, policy_entropy=True
            )
            return jnp.sum(jnp.linspace(-1.0, 2.0, 12) * stats.policy_entropy), stats

        return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(h, w)

    (_, one), g_one = run(h, w, y, None)
    (_, many), g_many = run(*placed, ys, mesh)
    np.testing.assert_allclose(many.policy_entropy, one.policy_entropy, rtol=1e-5)
    for a, b in zip(g_many, g_one, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max())


# ----------------------------------------------------------------------------- the update

# Plain SGD and the tiny model, batch and update of tests/test_train_step.py (the same program
# when the terms are off, so the session's compilation cache holds it once).
SGD = optax.apply_if_finite(optax.sgd(1.0), 10)


def test_off_switches_are_todays_program():
    """kl_coef = entropy_coef = 0 with the other KL fields changed: the same lowered update as
    the default loss, and bit-equal results; the state keeps no reference."""
    batch = jax.tree.map(jnp.asarray, synthetic_batch(64, 8, 10, 4, 0))
    default = LossConfig.preset("dvp", log_rho=-3.0)
    off = dataclasses.replace(default, kl_estimator="k1", kl_reference_dtype="bfloat16")
    out = []
    for cfg in (default, off):
        graphdef, state, _ = init_train_state(tiny_model(seed=1), SGD, 0, Sharder())
        assert state.ref_params is None
        fn = jax.jit(
            lambda s, b, cfg=cfg, graphdef=graphdef: step_lib.rl_update(
                s,
                b,
                graphdef=graphdef,
                optimizer=SGD,
                loss_cfg=cfg,
                chunk_size=16,
                micro_batches=1,
            )
        )
        out.append((fn.lower(state, batch).as_text(debug_info=False), fn(state, batch)))
    assert out[0][0] == out[1][0]
    jax.tree.map(np.testing.assert_array_equal, out[0][1], out[1][1])
    assert batch_lib.abstract_batch(8, 10).ref_logp is None
    assert batch_lib.abstract_batch(8, 10, True).ref_in_safe.shape == (8, 9)


def test_reference_is_a_copy_in_its_dtype_renewed_when_rl_starts():
    """The reference holds its own buffers (donating the params never donates it), in its
    dtype; `with_fresh_optimizer` (RL starting after the warm-up) makes it the new params."""
    graphdef, state, _ = init_train_state(tiny_model(seed=1), SGD, 0, Sharder(), "bfloat16")
    pairs = list(zip(jax.tree.leaves(state.params), jax.tree.leaves(state.ref_params), strict=True))
    for p, r in pairs:
        assert r.dtype == jnp.bfloat16 and p.unsafe_buffer_pointer() != r.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(r), np.asarray(p.astype(jnp.bfloat16)))
    _, f32, _ = init_train_state(tiny_model(seed=1), SGD, 0, Sharder(), "float32")
    warmed = jax.tree.map(lambda p: p + 1.0, f32.params)
    fresh = with_fresh_optimizer(f32, warmed, SGD, None)
    for p, r in zip(jax.tree.leaves(fresh.params), jax.tree.leaves(fresh.ref_params), strict=True):
        assert r.dtype == jnp.float32 and p.unsafe_buffer_pointer() != r.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(r), np.asarray(p))
    np.testing.assert_array_equal(fresh.ref_params["embed"], np.asarray(warmed["embed"]))
    # The bf16 reference runs the trainer's fp32 forward on its rounded weights (unpruned here,
    # so no safe-set boundary flips): close to the fp32 log-probs (2e-2: bf16 has 8 bits of
    # mantissa) but not equal.
    logprobs = jax.jit(
        lambda params, b: (
            step_lib.token_logprobs(
                params,
                graphdef,
                b.tokens,
                b.positions,
                b.valid,
                log_rho=-math.inf,
                temperature=1.0,
                chunk_size=16,
            ).logp
        )
    )
    batch = jax.tree.map(jnp.asarray, synthetic_batch(64, 8, 10, 4, 0))
    lp32, lp16 = logprobs(state.params, batch), logprobs(state.ref_params, batch)
    assert lp16.dtype == jnp.float32 and not np.array_equal(lp16, lp32)
    np.testing.assert_allclose(lp16, lp32, atol=2e-2)


# ----------------------------------------------------------------------------- the trainer


def test_trainer_reference_is_the_rl_start_policy_and_survives_resume(tmp_path):
    """Two RL steps (after the 2-step warm-up) with kl_coef > 0: kl_ref ~ 0 at step 1 (pi =
    pi_ref; two programs, so 1e-9 for k3 ~ d^2 / 2), > 0 at step 2; the reference is frozen (not
    the trained params) and the checkpoint restores it bit for bit, through the restore that
    `Trainer.run` resumes with."""
    from dvp_jax.checkpoint import abstract_like

    over = {"train.steps": 2, "loss.kl_coef": 0.05, "loss.entropy_coef": 0.01, "eval.every": 0}
    trainer = tiny_trainer(str(tmp_path), **over)
    try:
        trainer.run()
        rows = [r for r in trainer.metrics_log.read() if "kl_ref" in r]
        reference = jax.tree.map(np.asarray, trainer.state.ref_params)
        params = jax.tree.map(np.asarray, trainer.state.params)
        target = abstract_like(trainer.state, trainer.parts.state_shardings)
        step, restored, _, _ = trainer.checkpointer.restore_latest(target, trainer.parts.data)
    finally:
        trainer.close()
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["kl_ref"] < 1e-9 < rows[1]["kl_ref"]
    assert all(r["entropy_bonus"] < 0 for r in rows)
    pairs = zip(jax.tree.leaves(reference), jax.tree.leaves(params), strict=True)
    assert any(not np.array_equal(a, b) for a, b in pairs)
    assert step == 2
    jax.tree.map(
        np.testing.assert_array_equal, reference, jax.tree.map(np.asarray, restored.ref_params)
    )


def test_aot_lowers_the_update_with_the_reference_for_a_tpu_topology():
    """`dvp_jax.aot` builds the update a kl_coef > 0 run jits (the reference params in its
    dtype in the state, the reference log-probs in the batch: `batch.abstract_batch`) and it
    lowers for a v5p topology from this host (compiling is tests/test_tpu_compile.py's job)."""
    from dvp_jax.plan import specs as aot
    from dvp_jax.plan.topology import topology_devices
    from dvp_jax.tokenizers import CharTokenizer
    from dvp_jax.train.config import ExperimentConfig
    from tests.train_utils import tiny_config_dict

    over = {"loss.kl_coef": 0.05, "loss.kl_reference_dtype": "bfloat16", "sft.steps": 0}
    cfg = ExperimentConfig.from_config_dict(
        tiny_config_dict(**over, **{"loss.entropy_coef": 0.01}), CharTokenizer().vocab_size
    )
    specs, _ = aot.train_specs(cfg, topology_devices("v5p:2x2x1"))
    update = specs[0]
    state, batch = update.args
    assert update.name == "rl_update"
    assert {x.dtype for x in jax.tree.leaves(state.ref_params)} == {jnp.dtype("bfloat16")}
    assert batch.ref_logp.shape == batch.ref_in_safe.shape == batch.response_mask.shape
    text = update.jitted.trace(*update.args).lower().as_text()
    assert "bf16" in text
