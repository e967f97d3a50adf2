"""The embedded default: DVP-RLOO on generated arithmetic, a ~0.3M-parameter model, 2 CPU cores.

Command:
  python -m dvp_jax.main --config configs/tiny_cpu.py --workdir /tmp/dvp_tiny
  (or `make demo`). Method: `--config.method=rloo|tis|mis|dvp|mis_dvp|icepop|geo_rs|k3_rs|
  skyrl_geo_tis|verl_seq_is_rs|opsm`,
  or the config argument `--config configs/tiny_cpu.py:mis_dvp`.
Hardware: 2 CPU cores, no accelerator.
Expected: the 600-step supervised warm-up takes the random model to 10-51% held-out avg@4 on
  2-operand +/- problems (operands 0..49), depending on the seed; 250 DVP-RLOO steps with bf16
  rollouts add -0.7 to +21 points (median +3.1; seed 0 with `make install`'s lock on a 2-core
  Intel Xeon: 12.3% -> 11.6%, PPL gap 0.016; five seeds in docs/results.md).
"""

from dvp_jax.train.config import default_config


def get_config(method: str = "dvp"):
    """Every field defaults as in `dvp_jax.train.config`; only what differs is set here."""
    return default_config(
        method,
        # ~0.3M parameters on the "tiny" preset: character vocabulary (tied), 2 layers.
        model=dict(d_model=128, head_dim=32, d_ff=256, max_position_embeddings=64),
        # Answers are at most 4 characters + EOS; 64 slots: half of a step's 128 responses.
        rollout=dict(max_decode_length=6, max_concurrent_decodes=64),
        # 128 responses of ~10 tokens packed ~2 to a 22-token row: 4 micro-batches, so the
        # update runs the 2 that hold them (train/packing.py).
        train=dict(
            steps=250, prompts_per_step=16, learning_rate=3e-4, chunk_size=64, micro_batches=4
        ),
        sft=dict(steps=600, warmup_steps=50),
        eval=dict(every=25, num_prompts=256),
        checkpoint=dict(every=50),
    )
