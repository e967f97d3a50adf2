# dvp_jax developer commands. `make test` is what CI runs (.ci/run).
#
#   make install              CPU (the default, and what CI uses)
#   make install ACCEL=cuda   NVIDIA GPU: jax with its CUDA 12 plugin
#   make install ACCEL=tpu    Cloud TPU VM: jax with the libtpu it pins
#
# jax is pinned here (not in pyproject.toml) so that the accelerator plugin, which must match
# jaxlib exactly, is pinned with it: to move both, change JAX_VERSION. Every ACCEL also gets the
# libtpu that jax[tpu]==JAX_VERSION pins (LIBTPU_VERSION; `pip install --dry-run
# "jax[tpu]==X"` names it for another jax): it is the TPU compiler `python -m dvp_jax.aot` and
# tests/test_tpu_compile.py use on a host without a TPU. An existing .venv of another ACCEL is
# reinstalled (`make clean` first to be sure).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ACCEL ?= cpu
JAX_VERSION := 0.10.2
LIBTPU_VERSION := 0.0.42.1
# The test extra's torch: 2.13.0 is a CPU wheel on this project's machines; on an index that
# serves only the CUDA build, pip takes that one (several GB; the tests still run on CPU).
TORCH_VERSION := 2.13.0
# `make test` runs the suite in this many pytest-xdist workers (2: CI's and the dev machines'
# cores; each worker holds its own 8 fake CPU devices). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

JAX_SPEC_cpu := jax==$(JAX_VERSION)
JAX_SPEC_cuda := jax[cuda12]==$(JAX_VERSION)
JAX_SPEC_tpu := jax[tpu]==$(JAX_VERSION)
JAX_SPEC := $(JAX_SPEC_$(ACCEL))
ifeq ($(JAX_SPEC),)
$(error ACCEL=$(ACCEL) is not one of: cpu, cuda, tpu)
endif

.PHONY: install test demo lint clean

$(VENV)/.installed-$(ACCEL): pyproject.toml packaging/seqio_standin/pyproject.toml
	rm -f $(VENV)/.installed-*
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel
	$(PY) -m pip install torch==$(TORCH_VERSION)
	# A code-less `seqio` first, so google-jetstream's requirement does not pull TensorFlow
	# (packaging/seqio_standin/pyproject.toml says why).
	$(PY) -m pip install ./packaging/seqio_standin
	$(PY) -m pip install '$(JAX_SPEC)' 'libtpu==$(LIBTPU_VERSION)' -e '.[test]'
	touch $@

install: $(VENV)/.installed-$(ACCEL)

test: $(VENV)/.installed-$(ACCEL)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

demo: $(VENV)/.installed-$(ACCEL)
	$(PY) -m dvp_jax.main --config configs/tiny_cpu.py --workdir $${WORKDIR:-/tmp/dvp_jax_demo}

lint: $(VENV)/.installed-$(ACCEL)
	$(PY) -m ruff format --check . && $(PY) -m ruff check .

clean:
	rm -rf $(VENV)
