"""The paper's setting (docs/design.md section 1): MIS+DVP-RLOO, Qwen3-14B-Base, DAPO, AIME25.

Command (on every worker of the slice; docs/tpu.md has the `python -m dvp_jax.launch run`
  line that starts it there):
  python -m dvp_jax.main --config configs/paper_qwen3_14b.py:mis_dvp --workdir gs://BUCKET/dvp14b \
    --config.data.path=/data/dapo_math_17k_filtered.parquet \
    --config.data.tokenizer=/data/Qwen3-14B-Base/tokenizer.json
  Method: the config argument (`:rloo|tis|mis|dvp|mis_dvp`, default mis_dvp) or
  `--config.method=...`. The weights are read from the local Hugging Face directory `HF_DIR`
  below (`model.hf_path`: config.json + safetensors; tokenizer.json for the tokenizer).
Data: the two files below, made once from the public datasets (downloaded where the network
  is reachable, then copied to /data on every worker):
  hf download open-r1/DAPO-Math-17k-Processed --repo-type dataset --include "en/*" \
    --local-dir /data/raw/dapo_math_17k_processed
  hf download math-ai/aime25 test.jsonl --repo-type dataset --local-dir /data/raw/aime25
  python -m dvp_jax.data.prepare --format dapo17k_processed \
    --input /data/raw/dapo_math_17k_processed/en/train-00000-of-00001.parquet \
    --out /data/dapo_math_17k_filtered.parquet
  python -m dvp_jax.data.prepare --format aime25 --input /data/raw/aime25/test.jsonl \
    --out /data/aime25.parquet
  (The filtered set is open-r1's deduplicated English subset of BytedTsinghua-SIA/DAPO-Math-17k;
  `--format dapo17k` converts the original, whose rows repeat problems, deduplicating it the
  same way (by problem text). AIME25's problems get DAPO's instruction, so they are asked as
  in training.)
Hardware: one Cloud TPU v5p-64 slice: 2x4x4 topology, 32 chips (64 TensorCores, one JAX device
  per chip in megacore mode), 8 hosts, 95 GB HBM per chip. Mesh (data, fsdp, tensor) =
  (1, 8, 4): tensor=4 divides the 40 query and 8 KV heads, keeps the per-decode-step collectives
  within 4 chips and cuts the bf16 rollout weights to a quarter per chip; fsdp takes the rest
  (fsdp=-1), so the same config also runs on larger slices. `python -m dvp_jax.aot --config
  configs/paper_qwen3_14b.py --topology v5p:4x4x2` compiles every program of it for that slice
  (no TPU needed) and prints per-chip memory (the figures: docs/tpu.md).
Expected (the paper's claims, not yet reproduced here): the rollout/training PPL gap stays flat
  under DVP while it drifts up under plain RLOO, and MIS+DVP's AIME25 avg@16 beats the best
  unpruned RLOO score by 26.55% (relative). Time: not measured.
Settings not stated in the paper (learning rate, warm-up, weight decay, step count, prompt length)
  follow verl's DAPO recipe and are marked "assumed" below.
"""

from dvp_jax.train.config import default_config

# Local Hugging Face directory of Qwen3-14B-Base (config.json, *.safetensors, tokenizer.json).
HF_DIR = "/data/Qwen3-14B-Base"

# AIME25 (30 problems, AIME I + II), DAPO layout (`prompt` + `reward_model.ground_truth`), made by
# `python -m dvp_jax.data.prepare --format aime25` (module docstring).
EVAL_PATH = "/data/aime25.parquet"


def get_config(method: str = "mis_dvp"):
    """Every field defaults as in `dvp_jax.train.config`; only what differs is set here."""
    c = default_config(method or "mis_dvp")

    c.model.preset = "qwen3_14b"  # 40 layers, d=5120, 40 q / 8 kv heads, d_ff=17408, V=151936
    c.model.vocab_size = 151_936  # the checkpoint's embedding rows (>= the tokenizer's 151,669)
    # Start from the base model's weights (checked against the preset's architecture at load).
    # Empty string: random init.
    c.model.hf_path = HF_DIR

    # v5p-64: 32 devices -> (data, fsdp, tensor) = (1, 8, 4). See the module docstring.
    c.mesh.tensor = 4

    # The paper's precision split: bf16 rollout (the default), fp32 trainer.
    c.rollout.max_decode_length = 16_384  # max response length
    # One engine per host on its 4 local chips (bf16 weights split 4 ways by ROLLOUT_RULES), one
    # slot per response of this host's share of the batch: 32 prompts x G=16 / 8 hosts = 64, so
    # every response decodes at once (more slots would have nothing to decode; fewer would read
    # the weights twice as many steps). Decode is paged (the default `decode_attention`): the
    # pool holds 64 x 18,432 positions x 40 layers in bf16 = 45 GiB per chip (decode loop peak
    # 60% of HBM), of which a step at mean response 4,096 holds at most 7 GiB live
    # (`plan/rollout_cost.py`; 13 GiB at 8,192). It stays full size (`kv_pages` unset): the decode
    # state lives only during rollouts, so nothing else wants the HBM, and a smaller pool would
    # preempt (and redo) the long tail at mean 16,384. Other slice sizes: 512 / hosts slots.
    c.rollout.max_concurrent_decodes = 64
    c.rollout.tensor_parallel = 4  # all 4 chips of a v5p host

    # loss: the defaults are the paper's: rho = e^-13 (log_rho -13), MIS cap C = 2 (E7).

    c.data.task = "math"
    # Filtered DAPO-Math-17k in the DAPO layout (`dvp_jax.data.prepare`, module docstring), local
    # jsonl or parquet (override on the command line; every host reads only its shard of the
    # rows). Another layout: data.prompt_key / answer_key / system_key.
    c.data.path = "/data/dapo_math_17k_filtered.parquet"
    c.data.tokenizer = f"{HF_DIR}/tokenizer.json"
    c.data.eval_path = EVAL_PATH  # AIME25, avg@16 (eval.k)
    c.data.max_prompt_len = 2048  # assumed (verl DAPO: max_prompt_length=2048)

    c.train.steps = 500  # assumed budget; not stated in the paper
    # Generation batch: 32 prompts in all (global; each of the 8 hosts rolls out 4 of them).
    c.train.prompts_per_step = 32
    c.train.group_size = 16  # G
    c.train.learning_rate = 1e-6  # assumed (verl DAPO)
    c.train.warmup_steps = 10  # assumed (verl DAPO)
    c.train.weight_decay = 0.1  # assumed (verl DAPO)
    # Mini-batch 32 prompts = the whole rollout batch: one optimizer update per batch (the
    # default updates_per_batch=1), so no PPO clip (E9). The 512 x 18,432-token batch is
    # accumulated over 64 micro-batches of 8 sequences (one per fsdp shard); `dvp_jax.aot`
    # gives the memory this implies.
    c.train.micro_batches = 64
    c.train.remat = "full"  # 16k-token responses: recompute block activations in the backward

    # RL from the base model: no supervised warm-up (the default sft.steps = 0).
    # AIME25 avg@16: 16 samples for each of the 30 problems (held-out data: EVAL_PATH above).
    c.eval.num_prompts = 30
    c.eval.k = 16
    return c
