"""Data: the generated tasks, math files, rewards and the grain pipelines.

- `tasks`: `Example`, `GeneratedTask`, `ArithmeticTask`.
- `running_sum`: `RunningSumTask` (long responses of running sums and Zipf "thought" words,
  ending in a marked answer).
- `math_data`: `load_math_dataset`, `LoadReport`, `render_messages` (DAPO-Math files).
- `rewards`: the reward functions, `parse_rewards` (a weighted spec) and `score`.
- `pipeline`: `make_prompt_iterator` (RL prompt batches), `sft_batch` / `sft_batch_for_step`.
"""
