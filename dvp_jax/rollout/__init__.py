"""Rollouts: a JetStream Engine for our model, min-p sampling, RL rollouts and gRPC serving.

Modules: `sampling` (E1/E4 min-p sampler), `engine` (`RolloutEngine`, a
`jetstream.engine.engine_api.Engine`), `offline` (`generate_rollouts` -> `RolloutBatch`),
`server` (`python -m dvp_jax.rollout.server`), `tokenizers`, `jetstream_compat` (the one shim).
Importing `engine` imports JetStream, which imports TensorFlow (seconds); this package's
`__init__` therefore imports nothing.
"""
