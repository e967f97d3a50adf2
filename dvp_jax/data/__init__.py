"""Data: the generated arithmetic task, math files, rewards and the grain pipelines.

- `tasks`: `ArithmeticTask`, `Example`, `load_math_dataset`, `LoadReport`.
- `rewards`: `exact_match_reward`, `math_verify_reward`, `compute_rewards`.
- `pipeline`: `make_prompt_iterator` (RL prompt batches), `sft_batch` / `sft_batch_for_step`.

See each module's docstring for the exact contracts.
"""
