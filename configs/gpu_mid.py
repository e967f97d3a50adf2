"""Mid-size: DVP-RLOO on harder generated arithmetic with a ~76M-parameter model, one GPU.

Command:
  python -m dvp_jax.main --config configs/gpu_mid.py --workdir /tmp/dvp_gpu_mid
  Method: `--config configs/gpu_mid.py:mis_dvp` (rloo | tis | mis | dvp | mis_dvp) or
  `--config.method=...`. A sweep over methods and seeds: an experiment file with this CONFIG,
  run by `python experiments/launch.py experiments/eNNN_*.py`.
Hardware: one GPU with >= 24 GB (H100 / H200 / A100 class); jax[cuda12] installed. The fp32
  trainer state (params + AdamW moments) is ~0.9 GB; the rollout KV cache (1024 slots x 24
  positions) is tiny; the activations of a 1024 x 24-token train step are a few GB.
Expected (not yet measured; fill in from the first run): the supervised warm-up reaches partial
  accuracy on 2-3 operand +/- problems with operands up to 999, RL then raises held-out avg@8
  accuracy; with bf16 rollouts the PPL gap of plain RLOO should exceed DVP's. Time: estimated
  under an hour on an H100 (3,000 SFT steps + 200 RL steps), not measured.
"""

import ml_collections


def get_config(method: str = "dvp") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.method = method or "dvp"  # rloo | tis | mis | dvp | mis_dvp (DESIGN.md section 2)

    # ~76M parameters: 12 x (attention 1.6M + SwiGLU 4.7M), character vocabulary (tied).
    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"  # base for the fields not set here (RoPE theta 1e4, tied embeddings)
    c.model.vocab_size = -1  # -1: the tokenizer's vocabulary rounded up to a multiple of 8
    c.model.d_model = 768
    c.model.n_layers = 12
    c.model.n_heads = 12
    c.model.n_kv_heads = 4
    c.model.head_dim = 64
    c.model.d_ff = 2048
    c.model.max_position_embeddings = 64

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))

    c.rollout = ml_collections.ConfigDict()
    c.rollout.dtype = "bfloat16"  # float32 | bfloat16 | bfloat16_fp8kv
    c.rollout.logit_noise = 0.0
    c.rollout.temperature = 1.0
    c.rollout.max_new_tokens = 8  # answers are at most 5 characters + EOS
    c.rollout.num_slots = 1024  # the whole rollout batch (64 prompts x G=16) at once

    c.loss = ml_collections.ConfigDict()
    c.loss.log_rho = -13.0
    c.loss.cap = 2.0
    c.loss.normalisation = "token_mean"
    c.loss.correction = ml_collections.config_dict.placeholder(str)
    c.loss.prune = ml_collections.config_dict.placeholder(bool)
    c.loss.ppo_clip_eps = ml_collections.config_dict.placeholder(float)

    c.data = ml_collections.ConfigDict()
    c.data.task = "arithmetic"
    c.data.path = ""
    c.data.tokenizer = "char"
    c.data.max_prompt_len = 16  # "999+999-999=" plus BOS is 13 characters
    c.data.seed = 0
    c.data.num_operands = 3
    c.data.min_operands = 2
    c.data.max_operand = 999
    c.data.ops = "+-"
    c.data.style = "symbolic"

    c.train = ml_collections.ConfigDict()
    c.train.steps = 200
    c.train.prompts_per_step = 64
    c.train.group_size = 16
    c.train.learning_rate = 2e-5
    c.train.warmup_steps = 10
    c.train.weight_decay = 0.0
    c.train.grad_clip = 1.0
    c.train.micro_batches = 1
    c.train.updates_per_batch = 1
    c.train.chunk_size = 64
    c.train.seed = 0

    c.sft = ml_collections.ConfigDict(
        dict(steps=3000, batch_size=256, learning_rate=1e-3, warmup_steps=200)
    )
    c.eval = ml_collections.ConfigDict(dict(every=20, num_prompts=512, k=8))
    c.checkpoint = ml_collections.ConfigDict(dict(every=50, keep=3))
    c.log_every = 1
    c.plots = True
    return c
