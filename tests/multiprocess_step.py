"""One DVP-RLOO train step in N processes (used by tests/test_multiprocess.py).

Usage: python tests/multiprocess_step.py OUT.npz NUM_PROCESSES PROCESS_ID PORT DEVICES_PER_PROC

Every process builds the same tiny model and the same synthetic global batch (fixed seeds),
contributes its rows with `make_array_from_process_local_data`, runs one jitted train step on a
mesh over all processes' devices, and process 0 writes the loss and the updated params.
"""

import os
import sys

out, num_processes, process_id, port, per_proc = sys.argv[1], *map(int, sys.argv[2:6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_proc}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
    )
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from dvp_jax.dvp.losses import LossConfig  # noqa: E402
from dvp_jax.model import ModelConfig, Transformer  # noqa: E402
from dvp_jax.sharding import TRAIN_RULES, MeshConfig, Sharder, init_sharded, make_mesh  # noqa: E402
from dvp_jax.train import step as step_lib  # noqa: E402
from dvp_jax.train.batch import batch_shardings  # noqa: E402
from dvp_jax.train.state import init_train_state, make_optimizer  # noqa: E402
from tests.train_utils import synthetic_batch  # noqa: E402

cfg = ModelConfig.preset("tiny")
mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=1))
sharder = Sharder(mesh, TRAIN_RULES)
model = init_sharded(lambda: Transformer(cfg, sharder=sharder, rngs=nnx.Rngs(0)), sharder)
optimizer = make_optimizer(1e-2, 0, 0.0, 1.0)
graphdef, state, state_sh = init_train_state(model, optimizer, 0, sharder)

# The same synthetic global batch in every process; each contributes its own rows.
B, T, P = 16, 12, 5
global_batch = synthetic_batch(cfg.vocab_size, B, T, P)
rows = B // num_processes
local = jax.tree.map(lambda x: x[process_id * rows : (process_id + 1) * rows], global_batch)
batch_sh = batch_shardings(global_batch, sharder)
batch = jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, x), local, batch_sh)

loss_cfg = LossConfig.preset("mis_dvp", log_rho=-2.0)
fn = step_lib.jit_step(
    lambda s, b: step_lib.rl_update(
        s,
        b,
        graphdef=graphdef,
        optimizer=optimizer,
        loss_cfg=loss_cfg,
        chunk_size=16,
        micro_batches=2,
    ),
    state_sh,
    batch_sh,
    sharder,
)
state, metrics = fn(state, batch)
params = multihost_utils.process_allgather(state.params, tiled=True)
flat = {
    "/".join(str(k.key) for k in path): np.asarray(v)
    for path, v in jax.tree.leaves_with_path(params)
}
if process_id == 0:
    np.savez(out, loss=np.asarray(metrics["loss"]), kept=np.asarray(metrics["kept_tokens"]), **flat)
print(f"process {process_id}: loss {float(metrics['loss']):.6f}", flush=True)
