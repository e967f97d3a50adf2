"""Rollouts: the decode programs, the RL engine and RL rollouts.

Modules: `state` (`EngineConfig`, `Prefix`, `DecodeState`), `sampling` (the E1/E4 min-p
sampler), `decode` (prefill, insert and the decode step and loop as pure functions), `engine`
(`RolloutEngine`, the batched engine the trainer uses; its jitted programs and shardings in
`programs`), `scheduler` (admission, pages, preemption, dispatch sizing), `weights` (the weight
sync's host side), `offline` (`generate_rollouts` -> `RolloutBatch`), `loading` (checkpoints
read into the rollout layout, for the server and `dvp_jax.evaluate`) and `quantize` (fake
weight quantization). JetStream serving is the serving wing, `dvp_jax.serve`, built on this
package; nothing here imports it, JetStream or its shim.
"""
