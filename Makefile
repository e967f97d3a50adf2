# dvp_jax developer commands. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: install test demo lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel
	# torch first: 2.13.0 is a local CPU wheel here; any other version pulls a multi-GB CUDA build.
	$(PY) -m pip install torch==$(TORCH_VERSION)
	$(PY) -m pip install -e '.[test]'
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

demo: $(VENV)/.installed
	$(PY) -m dvp_jax.main --config configs/tiny_cpu.py --workdir $${WORKDIR:-/tmp/dvp_jax_demo}

lint: $(VENV)/.installed
	$(PY) -m ruff format --check . && $(PY) -m ruff check .

clean:
	rm -rf $(VENV)
