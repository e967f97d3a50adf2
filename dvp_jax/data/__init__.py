"""Data: the generated tasks, math files, rewards and the grain pipelines.

- `tasks`: `GeneratedTask`, `ArithmeticTask`, `Example`, `load_math_dataset`, `LoadReport`.
- `running_sum`: `RunningSumTask` (e004: long responses of running sums and Zipf "thought"
  words, ending in a marked answer).
- `rewards`: `exact_match_reward`, `marked_answer_reward`, `math_verify_reward`,
  `compute_rewards`.
- `pipeline`: `make_prompt_iterator` (RL prompt batches), `sft_batch` / `sft_batch_for_step`.

See each module's docstring for the exact contracts.
"""
