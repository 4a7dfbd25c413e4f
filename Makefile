# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Horovod (optional extra) is built from source for the tests: ~3 min once,
# then a cached wheel under .venv/horovod-wheels.
HOROVOD := $(VENV)/.horovod

.PHONY: demo test test-fast bench clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples]"
	touch $(STAMP)

$(HOROVOD): $(STAMP) scripts/install_horovod.sh
	bash scripts/install_horovod.sh $(VENV)
	touch $(HOROVOD)

demo: $(STAMP)
	$(PY) examples/train_digits.py --config configs/digits.json
	$(VENV)/bin/keras-distrib launch -n 2 examples/train_digits.py --config configs/digits_2workers.json

test: $(HOROVOD)
	$(PY) -m pytest -q

test-fast: $(HOROVOD)
	$(PY) -m pytest -q -m "not slow"

bench: $(HOROVOD)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/weak_scaling.py
	PATH=$(VENV)/bin:$$PATH $(PY) benchmarks/horovod_vs_tf.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
