"""Serving: the RL engine behind JetStream's gRPC API (serving only; the trainer never loads it).

Modules: `jetstream` (`JetStreamEngine`, JetStream's `engine_api.Engine` on the RL engine),
`server` (`python -m dvp_jax.serve.server`; its checkpoints load through `rollout.loading`) and
`jetstream_compat` (what JetStream 0.2.2 lacks on a current install: `jax.tree_map` and a seqio
stand-in, so no TensorFlow is imported). Only `jetstream` and `server` import JetStream, each
after `jetstream_compat`: the rest of dvp_jax (the trainer, the engine, the loss, the model, the
planning wing) loads neither JetStream nor the shim, and leaves `jax` as it is.
"""
