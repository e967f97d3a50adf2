"""DVP-RLOO loss core: pruning (E1-E3), advantages (E8), losses (E5-E9), diagnostics (E10).

All functions are pure functions of arrays; the caller jits. Equation numbers refer to
docs/design.md section 2.
"""

from dvp_jax.dvp import advantages, diagnostics, losses, pruning
from dvp_jax.dvp.losses import LossConfig, dvp_loss
from dvp_jax.dvp.pruning import TokenLogprobs, chunked_pruned_logprobs

__all__ = [
    "LossConfig",
    "TokenLogprobs",
    "advantages",
    "chunked_pruned_logprobs",
    "diagnostics",
    "dvp_loss",
    "losses",
    "pruning",
]
