"""e007: RLOO / DVP / MIS+DVP / IcePop on the tail-sum task, whose free positions carry a tail.

The task (`data.task="tail_sum"`, dvp_jax/data/tail_sum.py): add 2 operands in 1..49 with a
running sum, each step followed by `THOUGHTS` free words, each the head word with probability
1 - `TAIL_MASS` and otherwise uniform over the other `WORDS` - 1 words, then the total after
`<ans>`. A tail word's probability, 0.1 / 99,999 = 1.0e-6, is 13.7 nats below the head's 0.9:
the whole tail lies outside the trainer's e^-13 safe set with 0.7 nats to spare (the bound,
`tail_sum.min_tail_words(0.1)`, is 49k words), so about 8% of a response's sampled tokens
(0.1 x its 48 free of 61 tokens) lie there if the policy learns the law. Sizes: the LM head
(d_model x ~101k) is most of every step's cost, so d_model is 64 and responses 58 tokens.

The mismatch is the rollout precision (`get_config("rloo:M3")`), as in configs/e004_running_sum.py
(`LEVELS`). Held-out avg@k is evaluated by a separate fp32 engine.

Command (a single unit; experiments/e007_tail.py runs the experiment):
  python -m dvp_jax.main --config configs/e007_tail_sum.py:rloo:M3 --workdir /tmp/e007_u
Hardware and times: experiments/README.md, e007.
"""

from dvp_jax.data.running_sum import tokenizer_spec
from dvp_jax.train.config import default_config

LEVELS = {
    "M0": "float32",
    "M1": "bfloat16_fp8kv",
    "M2": "bfloat16_fp8kv_fp8w",
    "M3": "bfloat16_fp8kv_int4w",
}
WORDS = 100_000
TAIL_MASS = 0.1
THOUGHTS = 24
OPERANDS = 2
MAX_OPERAND = 49
RESPONSE_LEN = OPERANDS * (4 + THOUGHTS) + 2  # 58 tokens, EOS excluded
SFT_STEPS = 600


def get_config(arg: str = "rloo:M3"):
    """`arg` is "METHOD" or "METHOD:LEVEL" (LEVEL one of `LEVELS`, default M3)."""
    method, _, level = (arg or "rloo").partition(":")
    level = level or "M3"
    if level not in LEVELS:
        raise ValueError(f"configs/e007_tail_sum.py: level {level!r} is not one of {list(LEVELS)}")
    c = default_config(method)

    c.data.task = "tail_sum"
    c.data.tokenizer = tokenizer_spec(WORDS)
    c.data.tail_sum = dict(  # TailSumTask's knobs, under its own names
        n_words=WORDS,
        tail_mass=TAIL_MASS,
        thoughts_per_step=THOUGHTS,
        min_operands=OPERANDS,
        max_operands=OPERANDS,
        min_operand=1,
        max_operand=MAX_OPERAND,
    )
    c.data.max_prompt_len = OPERANDS + 3  # BOS, "sum", operands, "="

    # A small Qwen3-style decoder: 2 layers, d_model 64, tied embeddings over ~101k ids.
    c.model.update(
        dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128),
        tie_embeddings=True,
    )
    c.rollout.dtype = LEVELS[level]
    c.rollout.max_decode_length = RESPONSE_LEN + 2  # >= the response + EOS
    c.rollout.max_concurrent_decodes = 64
    c.model.max_position_embeddings = 80  # >= max_prompt_len + max_decode_length

    c.train.steps = 100
    c.train.prompts_per_step = 8
    c.train.group_size = 8
    c.train.learning_rate = 2e-4
    c.train.chunk_size = 2048

    c.sft.steps = SFT_STEPS
    c.sft.batch_size = 32
    c.sft.learning_rate = 3e-3
    c.sft.warmup_steps = 20

    c.eval.dtype = "float32"
    c.eval.k = 8
    c.eval.num_prompts = 32
    c.eval.every = 0
    c.checkpoint.every = 25
    c.plots = False
    return c
