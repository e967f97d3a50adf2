"""Planning: what a config costs on a TPU pod, worked out on any host before the pod is booked.

Modules: `aot` (the command, `python -m dvp_jax.aot`), `topology` (chips and topologies),
`specs` (a run's programs as it builds them), `compiled` (a program compiled: per-chip bytes,
FLOPs with loop trip counts, the table), `length_mix` (a step's response lengths from a mean or
a file), `update_cost` and `rollout_cost` (the step's update and rollout at real lengths; the
rollout's replays the engine's scheduler), `reports` (those costs printed for the command) and
`tables` (the one table formatter). The wing sits above the trainer and the rollout side and
builds their programs with their own code; nothing below it imports it.
"""
