# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.core
STAMP  := $(VENV)/.installed
# Horovod (optional extra) is built from source for the tests: ~1.5 min once,
# then a cached wheel under .venv/horovod-wheels.
HOROVOD_WHEEL := $(VENV)/.horovod-wheel
HOROVOD := $(VENV)/.horovod

.PHONY: demo setup bed-packages test test-fast test-unit test-float lint typecheck docs zoo-matrix conformance-matrix bench clean

# The package with TensorFlow and Keras, and what the Horovod build needs.
$(CORE): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e . setuptools wheel packaging
	touch $(CORE)

# The extras: tests, benchmarks, Ray, docs, mpi4py, linters.
$(STAMP): $(CORE)
	$(PY) -m pip install --quiet -e ".[test,bench,ray,docs,mpi,lint]"
	touch $(STAMP)

# The wheel needs only TensorFlow, and its build writes nothing into the
# venv: `make setup` compiles it while the extras install.
$(HOROVOD_WHEEL): $(CORE) scripts/install_horovod.sh
	bash scripts/install_horovod.sh --wheel-only $(VENV)
	touch $(HOROVOD_WHEEL)

$(HOROVOD): $(HOROVOD_WHEEL) $(STAMP)
	bash scripts/install_horovod.sh $(VENV)
	touch $(HOROVOD)

# Everything the tests need, the Horovod build beside the rest, and Slurm
# and Open MPI for their test beds (Debian's packages, as root; one line and
# skipped tests elsewhere).
setup:
	$(MAKE) -j3 $(HOROVOD) docs bed-packages

bed-packages:
	bash scripts/install_test_beds.sh

# The last two runs are also kept in $(VENV)/demo-*.log for the summary:
# synchronous (multi_worker, 2 workers) vs asynchronous (parameter server,
# 2 workers + 1 ps), same model, data and batch size.
DEMO_LOG := $(VENV)/demo
demo: $(STAMP)
	$(PY) examples/train_digits.py --config configs/digits.json
	{ $(VENV)/bin/keras-distrib launch -n 2 examples/train_digits.py --config configs/digits_2workers.json 2>&1; \
	  echo $$? > $(DEMO_LOG)-sync.rc; } | tee $(DEMO_LOG)-sync.log; exit $$(cat $(DEMO_LOG)-sync.rc)
	{ $(VENV)/bin/keras-distrib launch --workers 2 --ps 1 examples/train_digits.py --config configs/digits_ps.json 2>&1; \
	  echo $$? > $(DEMO_LOG)-async.rc; } | tee $(DEMO_LOG)-async.log; exit $$(cat $(DEMO_LOG)-async.rc)
	@echo "== sync (multi_worker, 2 workers) vs async (parameter_server, 2 workers + 1 ps) =="
	@for run in sync async; do \
	  acc=$$(grep -ho 'validation accuracy: [0-9.]*' $(DEMO_LOG)-$$run.log | tail -1 | cut -d' ' -f3); \
	  tput=$$(grep -ho 'throughput: [0-9,]* samples/s' $(DEMO_LOG)-$$run.log | tail -1 | cut -d' ' -f2); \
	  printf '%-6s validation accuracy %s  throughput %s samples/s\n' $$run "$$acc" "$$tput"; \
	done
	# A model whose weights + Adam state exceed one device's budget, trained
	# split over 2 logical CPUs with each model-parallel strategy in turn.
	{ $(PY) examples/train_split_model.py --config configs/split_model.json 2>&1; \
	  echo $$? > $(DEMO_LOG)-split.rc; } | tee $(DEMO_LOG)-split.log; exit $$(cat $(DEMO_LOG)-split.rc)
	@echo "== too large for one device: pipeline vs tensor_parallel (configs/split_model.json) =="
	@grep -h -e 'one device would need' -e '^result: ' $(DEMO_LOG)-split.log | sed 's/^result: //'
	# Its data-parallel sibling: the whole model on each of 2 workers, Adam's
	# state sharded over them (multi_worker, optimizer_sharding="optimizer").
	{ $(VENV)/bin/keras-distrib launch -n 2 examples/train_split_model.py --config configs/sharded_optimizer.json 2>&1; \
	  echo $$? > $(DEMO_LOG)-sharded.rc; } | tee $(DEMO_LOG)-sharded.log; exit $$(cat $(DEMO_LOG)-sharded.rc)
	@echo "== the same model, Adam's state sharded over 2 workers (configs/sharded_optimizer.json) =="
	@grep -h '^\[rank 0\] result: ' $(DEMO_LOG)-sharded.log | sed 's/^\[rank 0\] result: //'

# The test tiers (tests/unit: pure Python, no TensorFlow; tests/integration:
# one process; tests/distributed: tests that start processes), the model
# zoo, then Keras's own tests on DistributedModel (tests/conformance):
# setup.cfg's testpaths. The 20 slowest tests are listed at the end.
# Three pytest-xdist workers, each test file whole in one of them, the
# long groups handed out first (see tests/conftest.py): on the 2-core CI
# machine a third keeps the cores busy while tests wait on processes they
# started.
XDIST := -n 3 --dist loadgroup --no-loadscope-reorder
# The project's own modules compiled once, before the tests start hundreds
# of processes that import them: where PYTHONDONTWRITEBYTECODE is set (CI
# images set it), each process would compile them again.
BYTECODE := $(PY) -m compileall -q keras_distrib tests benchmarks examples
# The docs are built first, so a broken page or link fails CI too, and
# the lint and type checks (make lint) run before the tests.
test: setup
	$(MAKE) --no-print-directory lint
	$(BYTECODE)
	$(PY) -m pytest -q $(XDIST) --durations=20

test-fast: setup
	$(BYTECODE)
	$(PY) -m pytest -q $(XDIST) tests/unit tests/integration

# Needs neither Horovod nor TensorFlow's start-up.
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# ruff's rules (pyproject.toml's [tool.ruff]) and its formatting (checked,
# not applied: `ruff format .` applies it) on every Python file of the
# repository, then the type check.
lint: typecheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy on the package, as pyproject.toml's [tool.mypy] says: the whole
# package in mypy's default mode, the modules users import strictly. Its
# cache lives in the venv, so a second run checks only what changed.
typecheck: $(STAMP)
	$(PY) -m mypy --cache-dir $(VENV)/.mypy_cache

# The one-process tests that compare float results, with the kernels of
# other machines: oneDNN's off (Eigen's), then oneDNN's for each CPU in
# FLOAT_ISAS (AVX2: a CPU without AVX-512), which sum in other orders than
# this CPU's. Not part of `make test`: each pass takes about as long as the
# integration tier. On a CPU with AVX512-FP16 a cap below it skips the
# float16 tests (oneDNN aborts on the float16 kernels TensorFlow picks for
# the CPU; tests/conftest.py says so).
FLOAT_TESTS := $(shell grep -l -E 'float_bounds|as_reference|assert_within|assert_trains_like_single|assert_array_equal|assert_allclose|pytest.approx' tests/integration/test_*.py) tests/zoo/test_zoo.py
FLOAT_ISAS ?= AVX2
test-float: setup
	TF_ENABLE_ONEDNN_OPTS=0 $(PY) -m pytest -q $(XDIST) $(FLOAT_TESTS)
	for isa in $(FLOAT_ISAS); do \
	  ONEDNN_MAX_CPU_ISA=$$isa $(PY) -m pytest -q $(XDIST) $(FLOAT_TESTS) || exit 1; \
	done

# The MkDocs site (mkdocs.yml, docs/) into $(VENV)/site; --strict makes
# every warning (a broken link, an API name that does not resolve) an error.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir $(VENV)/site

# Runs the model zoo (tests/zoo) and writes its zoo x strategy matrix into
# docs/zoo.md (make test checks that the page says what the zoo found).
zoo-matrix: $(HOROVOD)
	KD_ZOO_WRITE_README=1 $(PY) -m pytest -q tests/zoo

# Writes docs/conformance.md's matrix from tests/conformance/expected.txt
# (make test checks that the page says what the conformance tier asserts).
conformance-matrix: $(STAMP)
	KD_CONFORMANCE_WRITE_PAGE=1 $(PY) -m pytest -q tests/conformance/test_matrix.py

# Each benchmark prints its table and saves its measurements as JSON under
# benchmarks/results/; _plots.py then draws the PNG figures from those files
# (redraw alone: $(PY) benchmarks/_plots.py). `make bench BENCH_FLAGS=--quick`
# tests the whole chain in a few minutes (quick numbers are not for reading;
# horovod_vs_tf and parameter_server take no BENCH_FLAGS).
BENCH_FLAGS ?=
bench: $(HOROVOD)
	$(PY) benchmarks/overhead.py $(BENCH_FLAGS)
	# 3 repeats keep make bench short (7, the default, also runs).
	$(PY) benchmarks/allreduce.py --repeats 3 $(BENCH_FLAGS)
	$(PY) benchmarks/weak_scaling.py $(BENCH_FLAGS)
	$(PY) benchmarks/host_engine.py $(BENCH_FLAGS)
	$(PY) benchmarks/strong_scaling.py $(BENCH_FLAGS)
	PATH=$(VENV)/bin:$$PATH $(PY) benchmarks/horovod_vs_tf.py
	PATH=$(VENV)/bin:$$PATH $(PY) benchmarks/parameter_server.py
	$(PY) benchmarks/model_parallel.py $(BENCH_FLAGS)
	$(PY) benchmarks/sparse_embeddings.py $(BENCH_FLAGS)
	$(PY) benchmarks/remat.py $(BENCH_FLAGS)
	$(PY) benchmarks/optimizer_sharding.py $(BENCH_FLAGS)
	$(PY) benchmarks/bigger_models.py $(BENCH_FLAGS)
	# Two hosts as network namespaces: needs root.
	PATH=$(VENV)/bin:$$PATH $(PY) benchmarks/multi_host.py $(BENCH_FLAGS)
	$(PY) benchmarks/tcp_engine.py $(BENCH_FLAGS)
	# 4 ranks, for the scaling model's checks beyond two (benchmarks/results/scaling/).
	PATH=$(VENV)/bin:$$PATH $(PY) benchmarks/multi_host.py --workers_per_host 2 --rates 1gbit,10gbit $(BENCH_FLAGS)
	$(PY) benchmarks/allreduce.py --nproc 4 --repeats 3 --bytes_per_pack 4194304 --sizes 4K,64K,1M,4M,16M,64M \
	  --json benchmarks/results/scaling/allreduce_nproc4_shm.json $(BENCH_FLAGS)
	$(PY) benchmarks/allreduce.py --nproc 4 --repeats 3 --implementation ring --bytes_per_pack 0 \
	  --sizes 4K,64K,1M,4M,16M,64M --json benchmarks/results/scaling/allreduce_nproc4_ring.json $(BENCH_FLAGS)
	$(PY) benchmarks/elastic.py $(BENCH_FLAGS)
	$(PY) benchmarks/chaos.py $(BENCH_FLAGS)
	# Fits and predicts from the results above; measures nothing.
	$(PY) benchmarks/scaling_model.py
	$(PY) benchmarks/_plots.py
	$(PY) benchmarks/results_md.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
