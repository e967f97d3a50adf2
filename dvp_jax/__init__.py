"""dvp_jax: Dynamic Vocabulary Pruning for stable LLM reinforcement learning, in JAX.

Importing the package changes nothing in JAX. On a host without TPU chips it tells libtpu
(installed with every backend so that `dvp_jax.aot` can compile for TPU topologies) that there
is no TPU to find: unset, libtpu asks the Cloud metadata server for one and prints start-up
errors in every process; and that several processes may load it (without a TPU, libtpu only
compiles; by default a second process fails on libtpu's lockfile). On a TPU VM nothing is set.
"""

import glob as _glob
import os as _os

if not (_glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*")):
    for _name, _value in (
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_ACCELERATOR_TYPE", "v5p-8"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_WORKER_ID", "0"),
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    ):
        _os.environ.setdefault(_name, _value)
