# dvp_jax developer commands. `make test` is what CI runs (.ci/run).
#
#   make install              CPU (the default, and what CI uses)
#   make install ACCEL=cuda   NVIDIA GPU: jax with its CUDA 12 plugin
#   make install ACCEL=tpu    Cloud TPU VM: jax with the libtpu it pins
#   make lock                 re-resolve the three locks (UPGRADE=1: newest versions allowed)
#
# `make install` installs the exact versions of requirements/$(ACCEL).txt, a lock of every package
# the venv holds but the project and the seqio stand-in. `make lock` writes the locks with uv
# from pyproject.toml's ranges (test extra included) and the pins below, which are the one
# source of the jax, libtpu and torch versions: `make install` refuses a lock that disagrees
# with them (run `make lock`). A plain `pip install .` takes pyproject.toml's ranges instead.
#
# jax is pinned here (not in pyproject.toml) so that the accelerator plugin, which must match
# jaxlib exactly, is pinned with it: to move both, change JAX_VERSION. Every ACCEL also gets the
# libtpu that jax[tpu]==JAX_VERSION pins (LIBTPU_VERSION; `pip install --dry-run
# "jax[tpu]==X"` names it for another jax): it is the TPU compiler `python -m dvp_jax.aot` and
# tests/test_tpu_compile.py use on a host without a TPU. An existing .venv is brought to the
# lock's versions in place (`make clean install` for a venv that holds nothing else).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ACCEL ?= cpu
JAX_VERSION := 0.10.2
LIBTPU_VERSION := 0.0.42.1
# The test extra's torch. The locks pin its version only (no file, no hashes, so no lock forces
# a download): pip takes the build its indexes offer, on this project's machines a local CPU
# wheel (the build the cpu lock describes: requirements/cpu-excludes.txt), elsewhere PyPI's
# CUDA build (several GB; with the cpu lock its CUDA libraries come unpinned; the tests still
# run on CPU).
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
LOCK := requirements/$(ACCEL).txt
LOCK_PINS := jax==$(JAX_VERSION) libtpu==$(LIBTPU_VERSION) torch==$(TORCH_VERSION)

# `make lock`: uv (pinned) in a venv of its own, so the project's venv stays equal to its lock.
UV_VERSION := 0.13.9
UV := $(VENV)-lock/bin/uv
# The locks are for Python 3.11 on x86_64 Linux (CI and this project's machines); glibc 2.31 is
# what libtpu's wheels need. The seqio stand-in takes part in the resolution (so google-jetstream's
# seqio requirement pulls no TensorFlow) and is left out of the lock: `make install` installs it
# from its folder. The cpu lock leaves out the CUDA libraries of PyPI's torch (cpu-excludes.txt).
LOCK_EXCLUDES_cpu := --excludes requirements/cpu-excludes.txt
define compile_lock
printf '%s\n' '$(JAX_SPEC_$(1))' 'libtpu==$(LIBTPU_VERSION)' 'torch==$(TORCH_VERSION)' pip \
	'seqio @ ./packaging/seqio_standin' \
	| $(UV) pip compile --quiet pyproject.toml --extra test - --no-emit-package seqio \
	--python-version 3.11 --python-platform x86_64-manylinux_2_31 $(LOCK_EXCLUDES_$(1)) \
	$(if $(UPGRADE),--upgrade) --custom-compile-command 'make lock' -o requirements/$(1).txt
endef

.PHONY: install lock test demo lint clean

$(VENV)/.installed-$(ACCEL): $(LOCK) pyproject.toml packaging/seqio_standin/pyproject.toml
	@for pin in $(LOCK_PINS); do grep -qxF $$pin $(LOCK) || { \
		echo "$(LOCK) does not pin $$pin, as the Makefile does: run make lock" >&2; exit 2; }; done
	rm -f $(VENV)/.installed-*
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "$$(grep -x 'pip==.*' $(LOCK))"
	# The lock's versions, with the code-less `seqio`, so google-jetstream's requirement does
	# not pull TensorFlow (packaging/seqio_standin/pyproject.toml says why).
	$(PY) -m pip install -r $(LOCK) ./packaging/seqio_standin -e '.[test]'
	touch $@

install: $(VENV)/.installed-$(ACCEL)

$(UV):
	$(PYTHON) -m venv $(VENV)-lock
	$(VENV)-lock/bin/python -m pip install uv==$(UV_VERSION)

lock: $(UV)
	$(call compile_lock,cpu)
	$(call compile_lock,cuda)
	$(call compile_lock,tpu)

# `make test`'s second pass: the tests that compare committed results (figures made on another
# machine) with a recomputation (marked `committed_results`), run again as a CPU without AVX-512
# computes them: numpy's AVX-512 dispatch groups off (numpy 2.4's names; it ignores a name it
# does not know), OpenBLAS's Haswell (AVX2) kernels, XLA's code capped at AVX2. On an AVX2-only
# CPU this changes nothing. tests/test_committed_results.py checks that each setting took effect.
AVX2_CPU := NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" OPENBLAS_CORETYPE=Haswell \
	XLA_FLAGS=--xla_cpu_max_isa=AVX2

test: $(VENV)/.installed-$(ACCEL)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests
	$(AVX2_CPU) $(PY) -m pytest -q -n 0 -m committed_results tests

demo: $(VENV)/.installed-$(ACCEL)
	$(PY) -m dvp_jax.main --config configs/tiny_cpu.py --workdir $${WORKDIR:-/tmp/dvp_jax_demo}

lint: $(VENV)/.installed-$(ACCEL)
	$(PY) -m ruff format --check . && $(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(VENV)-lock
