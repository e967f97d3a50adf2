"""Rollouts: a JetStream Engine for our model, min-p sampling, RL rollouts and gRPC serving.

Modules: `sampling` (E1/E4 min-p sampler), `engine` (`RolloutEngine`, a
`jetstream.engine.engine_api.Engine`), `offline` (`generate_rollouts` -> `RolloutBatch`),
`server` (`python -m dvp_jax.rollout.server`), `tokenizers`, `jetstream_compat` (what JetStream
0.2.2 lacks today: `jax.tree_map` and a seqio stand-in, so no TensorFlow is imported). This
`__init__` imports `jetstream_compat` only, before any module imports JetStream.
"""

from dvp_jax.rollout import jetstream_compat  # noqa: F401  (before any jetstream import)
