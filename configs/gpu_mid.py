"""Mid-size: DVP-RLOO on harder generated arithmetic with a ~76M-parameter model, one GPU.

Command:
  python -m dvp_jax.main --config configs/gpu_mid.py --workdir /tmp/dvp_gpu_mid
  Method: `--config configs/gpu_mid.py:mis_dvp` (rloo | tis | mis | dvp | mis_dvp) or
  `--config.method=...`. A sweep over methods and seeds: an experiment file with this CONFIG,
  run by `python -m dvp_jax.launch local experiments/eNNN_*.py`.
Hardware: one GPU with >= 24 GB (H100 / H200 / A100 class); jax[cuda12] installed. The fp32
  trainer state (params + AdamW moments) is ~0.9 GB; the rollout KV cache (1024 slots x 24
  positions) is tiny; the activations of a 1024 x 24-token train step are a few GB.
Expected (not yet measured; fill in from the first run): the supervised warm-up reaches partial
  accuracy on 2-3 operand +/- problems with operands up to 999, RL then raises held-out avg@8
  accuracy; with bf16 rollouts the PPL gap of plain RLOO should exceed DVP's. Time: estimated
  under an hour on an H100 (3,000 SFT steps + 200 RL steps), not measured.
"""

from dvp_jax.train.config import default_config

# ~76M parameters: 12 x (attention 1.6M + SwiGLU 4.7M), character vocabulary (tied). The "tiny"
# preset supplies the fields not set here (RoPE theta 1e4, tied embeddings).
MODEL = dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, d_ff=2048)


def get_config(method: str = "dvp"):
    """Every field defaults as in `dvp_jax.train.config`; only what differs is set here."""
    return default_config(
        method,
        model=dict(MODEL, max_position_embeddings=64),
        rollout=dict(
            max_decode_length=8,  # answers are at most 5 characters + EOS
            max_concurrent_decodes=1024,  # the whole rollout batch (64 prompts x G=16) at once
        ),
        # 2-3 operands up to 999: "999+999-999=" plus BOS is 13 characters, within the default
        # max_prompt_len 16.
        data=dict(arithmetic=dict(num_operands=3, min_operands=2, max_operand=999)),
        train=dict(
            steps=200,
            prompts_per_step=64,
            group_size=16,
            learning_rate=2e-5,
            warmup_steps=10,
            chunk_size=64,
        ),
        sft=dict(steps=3000, batch_size=256, learning_rate=1e-3, warmup_steps=200),
        eval=dict(every=20, num_prompts=512, k=8),
        checkpoint=dict(every=50),
    )
