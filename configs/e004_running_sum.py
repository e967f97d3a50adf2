"""e004: RLOO / TIS / MIS / DVP / MIS+DVP on the running-sum task under the mismatch ladder.

The task (`data.task="running_sum"`, dvp_jax/data/running_sum.py): add 1-3 operands in 1..9
with a running sum, each step followed by free "thought" words drawn from a Zipf law, then the
total after `<ans>`; responses are 150-190 tokens (EOS excluded), so the rollout mismatch adds up
over ~175 high-entropy tokens. The thought law (6,000 words, Zipf exponent 1.5) just reaches the
e^-13 safe-set threshold at its last rank (ln(p_min / p_max) = -13.05), so an extreme tail
exists (measured: 0.06% of sampled tokens of the warm start lie outside the trainer's e^-13 safe
set). 1-operand problems are a copy, so a short warm start scores above zero; 3 operands keep ~80
distinct held-out problems. Reward: the integer after the last `<ans>` equals the total; a
truncated response scores 0.

The mismatch is the rollout precision, a sweep argument (`get_config("dvp:M1")`, or
`--config.rollout.dtype=...`): M0 "float32" (no mismatch), M1 "bfloat16_fp8kv", M2
"bfloat16_fp8kv_fp8w", M3 "bfloat16_fp8kv_int4w" (`LEVELS`). The held-out avg@16 is always
evaluated by a separate fp32 engine (`eval.dtype="float32"`), so it scores the policy, not the
rollout.

Command (a single unit; experiments/e004_running_sum.py runs the stages):
  python -m dvp_jax.main --config configs/e004_running_sum.py:rloo:M0 --workdir /tmp/e004_u
Hardware: 2 CPU cores shared with other jobs. Sizes were chosen by timing 5 RL steps there (see
  experiments/README.md, e004): 1.19M parameters (0.90M of them the tied embedding), 8 prompts x
  8 responses; ~8.5 s per RL step, ~50 s per fp32 avg@16 evaluation (32 prompts x 16).
Expected: see experiments/README.md (e004) and experiments/results/e004/.
"""

from dvp_jax.data.running_sum import tokenizer_spec
from dvp_jax.train.config import default_config

# The mismatch ladder of issue 14 (rollout.dtype of each level).
LEVELS = {
    "M0": "float32",
    "M1": "bfloat16_fp8kv",
    "M2": "bfloat16_fp8kv_fp8w",
    "M3": "bfloat16_fp8kv_int4w",
}
THOUGHT_WORDS = 6_000
MAX_RESPONSE_LEN = 190
MAX_OPERANDS = 3


def get_config(arg: str = "dvp:M1"):
    """`arg` is "METHOD" or "METHOD:LEVEL" (LEVEL one of `LEVELS`, default M1)."""
    method, _, level = (arg or "dvp").partition(":")
    level = level or "M1"
    if level not in LEVELS:
        raise ValueError(
            f"configs/e004_running_sum.py: level {level!r} is not one of {list(LEVELS)}"
        )
    c = default_config(method)

    c.data.task = "running_sum"
    c.data.thought_words = THOUGHT_WORDS
    c.data.tokenizer = tokenizer_spec(THOUGHT_WORDS)
    c.data.thought_zipf = 1.5
    c.data.sum_min_operands = 1
    c.data.sum_max_operands = MAX_OPERANDS
    c.data.sum_min_operand = 1
    c.data.sum_max_operand = 9
    c.data.min_response_len = 150
    c.data.max_response_len = MAX_RESPONSE_LEN
    c.data.max_prompt_len = MAX_OPERANDS + 3  # BOS, "sum", operands, "="

    # A small Qwen3-style decoder: 2 layers, d_model 128, tied embeddings over ~7,000 ids.
    c.model.d_model = 128
    c.model.n_layers = 2
    c.model.n_heads = 4
    c.model.n_kv_heads = 2
    c.model.head_dim = 32
    c.model.d_ff = 256
    c.model.tie_embeddings = True
    c.rollout.max_decode_length = MAX_RESPONSE_LEN + 2  # >= max_response_len + 1 (EOS)
    c.model.max_position_embeddings = 256  # >= max_prompt_len + max_decode_length
    c.rollout.dtype = LEVELS[level]

    c.train.steps = 100
    c.train.prompts_per_step = 8
    c.train.group_size = 8
    c.train.learning_rate = 3e-4
    c.train.chunk_size = 2048

    c.sft.steps = 400
    c.sft.batch_size = 16
    c.sft.learning_rate = 3e-3
    c.sft.warmup_steps = 20

    c.eval.dtype = "float32"
    c.eval.k = 16
    c.eval.num_prompts = 32
    c.eval.every = 0
    c.checkpoint.every = 25
    c.plots = False
    return c
