"""Rollouts: the decode programs, the RL engine, RL rollouts, and JetStream serving.

Modules: `state` (`EngineConfig`, `Prefix`, `DecodeState`), `sampling` (the E1/E4 min-p
sampler), `decode` (prefill, insert and the decode step and loop as pure functions), `engine`
(`RolloutEngine`, the batched engine the trainer uses), `weights` (the weight sync's host side),
`offline` (`generate_rollouts` -> `RolloutBatch`), `jetstream` (`JetStreamEngine`, JetStream's
`engine_api.Engine` on the RL engine), `server` (`python -m dvp_jax.rollout.server`) and
`loading` (its checkpoints), `tokenizers`, `quantize` (fake weight quantization) and
`jetstream_compat` (what JetStream 0.2.2 lacks today: `jax.tree_map` and a seqio stand-in, so no
TensorFlow is imported). Only `jetstream` and `server` import JetStream, each after
`jetstream_compat`: the rest of dvp_jax (the trainer, the engine, the loss, the model, `aot`)
loads neither JetStream nor the shim, and leaves `jax` as it is.
"""
