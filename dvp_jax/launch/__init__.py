"""Runs experiments' work units on this machine or on a Cloud TPU VM slice.

`sweep` turns an experiment file into work units and trainer commands, `local` runs them here,
`tpu` and `workers` build the gcloud commands of a slice and what its workers run, `cli` is
`python -m dvp_jax.launch`, `xm` the XManager variant. The launcher knows nothing of the model:
it forwards `--config FILE[:ARG]` and `--config.a.b=value` flags to `python -m dvp_jax.main`.
"""
