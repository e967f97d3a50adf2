"""Experiments: one file per experiment (`get_sweep()` + analysis), the launchers and the shared
analysis helpers. A package so experiments import each other normally; run every file as a
module from the repository root, e.g. `python -m experiments.e002_methods` (see README.md)."""
