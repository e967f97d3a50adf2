"""The one compatibility shim between google-jetstream 0.2.2 and modern JAX.

JetStream 0.2.2 (the last release; upstream is archived) calls `jax.tree_map` in
`jetstream.core.orchestrator.delete_pytree`, which the generate thread runs after every insert.
Modern JAX removed `jax.tree_map`; the resulting AttributeError kills the generate thread, and
JetStream's `JetThread` then SIGKILLs the whole process. `jax.tree.map` is the same function, so
we alias it when it is missing. Import this module before `jetstream.core.orchestrator` (the
rollout package's modules that use the orchestrator do so at their top).
"""

import jax

if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map
