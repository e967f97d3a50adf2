"""TPU chips and topologies as the planning wing sees them: each chip's HBM, bf16 peak and HBM
bandwidth per JAX device, and a topology's devices compiled for from any host (libtpu, no TPU).
"""

from __future__ import annotations

import re

# Usable HBM per JAX device in GiB, as the TPU compiler reports it ("exceeds available HBM")
# for libtpu 0.0.42.1. A v4 chip is two devices (16 GiB each); v5p, v5e, v6e one per chip.
CHIP_HBM_GIB = {"v4": 15.25, "v5e": 15.75, "v5p": 95.74, "v6e": 31.25}
# Dense bf16 matmul peak per JAX device, FLOP/s (Cloud TPU system-architecture pages: v5p 459,
# v5e 197, v6e 918 TFLOP/s per chip; v4 275 per chip, two devices).
CHIP_BF16_FLOPS = {"v4": 137.5e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
# HBM bandwidth per JAX device, bytes/s (the same pages: v5p 2,765, v5e 819, v6e 1,640 GB/s per
# chip; v4 1,228 per chip, two devices).
CHIP_HBM_BYTES_PER_S = {"v4": 0.614e12, "v5e": 0.819e12, "v5p": 2.765e12, "v6e": 1.64e12}


def topology_devices(name: str) -> list:
    """The devices of TPU topology `name` (e.g. "v5p:2x2x1"), compiled for from this host.

    Raises:
      ValueError: naming the allowed chips and the form, for a name that is not one.
    """
    from jax.experimental import topologies

    match = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})", name)
    if match is None:
        raise ValueError(
            f"--topology {name!r} is not <chip>:<dims> with chip one of {sorted(CHIP_HBM_GIB)} "
            "and dims like 2x2 or 4x4x2 (e.g. v5p:4x4x2 is a v5p-64, 32 chips)"
        )
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu missing, or a shape this chip does not come in
        raise ValueError(f"--topology {name!r}: {str(e).splitlines()[0]}") from e


def chip_of(topology: str) -> str:
    return topology.split(":")[0]
