"""DVP-RLOO loss core: pruning (E1-E3; `chunked`, the trainer's vocabulary-chunked form, laid
out on a mesh by `vocab_mesh`), advantages (E8), losses (E5-E9), diagnostics and the E10 bound.

All functions are pure functions of arrays; the caller jits. Equation numbers refer to
docs/design.md section 2.
"""

from dvp_jax.dvp import advantages, chunked, diagnostics, losses, pruning
from dvp_jax.dvp.chunked import chunked_pruned_logprobs
from dvp_jax.dvp.losses import LossConfig, dvp_loss
from dvp_jax.dvp.pruning import TokenLogprobs

__all__ = [
    "LossConfig",
    "TokenLogprobs",
    "advantages",
    "chunked",
    "chunked_pruned_logprobs",
    "diagnostics",
    "dvp_loss",
    "losses",
    "pruning",
]
