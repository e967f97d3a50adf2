"""Mid-size: DVP-RLOO on harder generated arithmetic with a ~76M-parameter model, one GPU.

Command:
  python -m dvp_jax.main --config configs/gpu_mid.py --workdir /tmp/dvp_gpu_mid
  Method: `--config configs/gpu_mid.py:mis_dvp` (rloo | tis | mis | dvp | mis_dvp) or
  `--config.method=...`. A sweep over methods and seeds: an experiment file with this CONFIG,
  run by `python -m experiments.launch experiments/eNNN_*.py`.
Hardware: one GPU with >= 24 GB (H100 / H200 / A100 class); jax[cuda12] installed. The fp32
  trainer state (params + AdamW moments) is ~0.9 GB; the rollout KV cache (1024 slots x 24
  positions) is tiny; the activations of a 1024 x 24-token train step are a few GB.
Expected (not yet measured; fill in from the first run): the supervised warm-up reaches partial
  accuracy on 2-3 operand +/- problems with operands up to 999, RL then raises held-out avg@8
  accuracy; with bf16 rollouts the PPL gap of plain RLOO should exceed DVP's. Time: estimated
  under an hour on an H100 (3,000 SFT steps + 200 RL steps), not measured.
"""

from dvp_jax.train.config import default_config


def get_config(method: str = "dvp"):
    """Every field defaults as in `dvp_jax.train.config`; only what differs is set here."""
    c = default_config(method)

    # ~76M parameters: 12 x (attention 1.6M + SwiGLU 4.7M), character vocabulary (tied). The
    # "tiny" preset supplies the fields not set here (RoPE theta 1e4, tied embeddings).
    c.model.d_model = 768
    c.model.n_layers = 12
    c.model.n_heads = 12
    c.model.n_kv_heads = 4
    c.model.head_dim = 64
    c.model.d_ff = 2048
    c.model.max_position_embeddings = 64

    c.rollout.max_decode_length = 8  # answers are at most 5 characters + EOS
    c.rollout.max_concurrent_decodes = 1024  # the whole rollout batch (64 prompts x G=16) at once

    # "999+999-999=" plus BOS is 13 characters: the default max_prompt_len 16 holds it.
    c.data.arithmetic.num_operands = 3
    c.data.arithmetic.min_operands = 2
    c.data.arithmetic.max_operand = 999

    c.train.steps = 200
    c.train.prompts_per_step = 64
    c.train.group_size = 16
    c.train.learning_rate = 2e-5
    c.train.warmup_steps = 10
    c.train.chunk_size = 64

    c.sft.steps = 3000
    c.sft.batch_size = 256
    c.sft.learning_rate = 1e-3
    c.sft.warmup_steps = 200
    c.eval.every = 20
    c.eval.num_prompts = 512
    c.eval.k = 8
    c.checkpoint.every = 50
    return c
