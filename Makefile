# `make demo` and `make test` do all the set-up on a fresh machine: they create .venv
# when it is missing, install the project with the pins of constraints.txt (a stamp
# file makes this a no-op when nothing changed), then run.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CUR_VENV := .venv-current
CUR_PY := $(CUR_VENV)/bin/python
CUR_STAMP := $(CUR_VENV)/.installed
S35_VENV := .venv-spark35
S35_PY := $(S35_VENV)/bin/python
S35_STAMP := $(S35_VENV)/.installed
S35_PYSPARK := 3.5.0
EXTRAS := spark,petastorm,ray,tensorflow,lightning,transformers,peft,mlflow,tensorboard,s3,mpi,notebooks,dev,s3-server
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The installs go through uv (pinned, in build/uv: a few times faster than pip over three
# venvs of ~200 packages), under the same constraints files. --compile-bytecode: the
# installed modules get their .pyc now, as pip's installs do (a process that imports
# torch or pyspark from sources alone compiles them again, every time).
# Disk: the three venvs and the pyspark builds come to about 7 GB. uv's cache lives in
# build/ (the venvs' file system, so uv hard-links its files into every venv instead of
# copying them) unless UV_CACHE_DIR says otherwise, and each install step drops
# pyspark's entries from it at the end (pyspark comes only as a source archive, and uv
# keeps the archive, its unpacked tree and the wheel built from it: 1.5 GB a version).
UV_VERSION := 0.13.9
UV := build/uv/bin/uv
export UV_CACHE_DIR ?= $(CURDIR)/build/uv-cache
UV_INSTALL = $(UV) pip install -q --compile-bytecode --python
UV_DROP_PYSPARK = $(UV) cache clean -q pyspark
# torch: pip chooses the file, once, into build/torch (pip's configuration on these
# machines, find-links, points at the CPU build on local disk; a looser spec than
# ==2.13.0 pulls a CUDA build of several GB), and uv installs that file into each venv:
# one unpacked copy in uv's cache, hard-linked into the three venvs.
TORCH_VERSION := 2.13.0
TORCH_STAMP := build/torch/.downloaded
TORCH_WHEEL = build/torch/torch-$(TORCH_VERSION)*.whl
# The project's own sources are compiled before each test run, for the same reason: with
# PYTHONDONTWRITEBYTECODE set (as on these machines) an editable install is never
# compiled, and every rank, Spark and Ray worker the tests start compiled ringcore and
# the runners again (about 0.7 s of CPU per process). .pyc files go to __pycache__/,
# which git ignores; a stale one is never used (Python checks the source's mtime).
PY_SOURCES := ringcore spark_runner ray_runner estimators ringrun tests bench tools notebooks examples

.PHONY: demo test test-side test-house test-current test-spark35 test-spark41 test-spark35-newest soak bench lint install clean reliability conformance conformance-examples cluster-up cluster-down

install: $(STAMP)

$(UV):
	$(PYTHON) -m pip install -q --target build/uv "uv==$(UV_VERSION)"

$(TORCH_STAMP):
	$(PYTHON) -m pip download -q --no-deps --dest build/torch "torch==$(TORCH_VERSION)"
	touch $@

$(STAMP): pyproject.toml constraints.txt Makefile $(TORCH_STAMP) | $(UV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(UV_INSTALL) $(PY) -c constraints.txt $(TORCH_WHEEL) -e ".[$(EXTRAS)]"
	$(UV_DROP_PYSPARK)
	$(PY) -m ringcore._stackcheck
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/digits_demo.py

# The whole suite on the main stack and, beside it, the house's own tests and the other
# stacks (below: tests/project and tests/ringrun on the main venv, then the other
# stacks' venvs built and their subsets, one after another, at a lower CPU priority,
# `nice -n 5`, into build/test-side.log, printed when both are done). The main suite
# leaves a core idle for part of its time (JVM and Ray start-ups, timeouts the fault
# tests wait out); the side run fills it. Fails when either fails.
# PYTEST_ARGS: more pytest options for the main suite (e.g. a JUnit report).
SIDE_NICE ?= 5
test: $(STAMP)
	$(PY) -m compileall -q $(PY_SOURCES)
	@mkdir -p build
	@echo "== the house tests and the other stacks run beside the main suite: build/test-side.log"
	@nice -n $(SIDE_NICE) $(MAKE) --no-print-directory test-side > build/test-side.log 2>&1 & side=$$!; \
	$(PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS) tests $(HOUSE_IGNORE); main=$$?; \
	echo "== the main suite: exit $$main; waiting for the other stacks"; \
	wait $$side; rc=$$?; cat build/test-side.log; \
	echo "== the main suite: exit $$main; the other stacks: exit $$rc"; \
	test $$main -eq 0 && test $$rc -eq 0

# Beside the main suite, one after another: the main stack's tests that share no Spark
# session or Ray instance with it (the house's own tests, ringrun's, the notebooks, the
# multi-host tests: on hosts, Spark and Ray clusters of their own, much of it waiting on
# timeouts), then the other stacks.
HOUSE_TESTS := tests/project tests/ringrun tests/end_to_end/test_notebooks.py \
	tests/end_to_end/test_multihost.py tests/end_to_end/test_multihost_faults.py
HOUSE_IGNORE := $(foreach t,$(HOUSE_TESTS),--ignore=$(t))
test-side: test-house test-current test-spark35 test-spark41 test-spark35-newest

test-house: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider $(HOUSE_TESTS)

# The second tested stack: the newest releases (constraints-current.txt: pyspark 4.3,
# ray 2.60, pyarrow 26, numpy 2, pandas < 3), without Petastorm (the Arrow reader), in
# its own venv; the data / store / estimator / Spark / Ray tests that do not need petastorm.
# `make test` runs it beside the main suite.
CURRENT_TESTS := tests/ringcore/test_data.py tests/estimators/test_stores.py \
	tests/estimators/test_estimator_fit.py tests/estimators/test_estimator_persistence.py \
	tests/spark_runner/test_spark_runner.py tests/ray_runner/test_ray_runner.py

$(CUR_STAMP): pyproject.toml constraints-current.txt Makefile $(TORCH_STAMP) | $(UV)
	test -x $(CUR_PY) || $(PYTHON) -m venv $(CUR_VENV)
	$(UV_INSTALL) $(CUR_PY) -c constraints-current.txt $(TORCH_WHEEL) -e ".[spark,ray,dev]"
	$(UV_DROP_PYSPARK)
	$(CUR_PY) -m ringcore._stackcheck
	touch $(CUR_STAMP)

# local-cluster (two executor JVMs per test) only on the main stack and Spark 3.5.0; the
# CrossValidator test (five fits) too.
test-current: $(CUR_STAMP)
	$(CUR_PY) -m compileall -q $(PY_SOURCES)
	$(CUR_PY) -m pytest -p no:cacheprovider \
		-k "not petastorm and not runs_past_one_epoch and not local-cluster and not cross_validator" \
		$(CURRENT_TESTS)

# The third tested stack: Spark 3.5 as the Databricks LTS runtimes have it. pyspark is
# installed first and ringtrain after it, without a pyspark pin (constraints-spark35.txt):
# the install must leave the runtime's pyspark alone, and the stamp step fails if it did
# not. Then the Spark runner, store, data and estimator tests (Connect: on 4.x only).
S35_TESTS := tests/ringcore/test_data.py tests/estimators/test_stores.py \
	tests/estimators/test_estimator_fit.py tests/estimators/test_estimator_persistence.py \
	tests/spark_runner/test_spark_runner.py

$(S35_STAMP): pyproject.toml constraints-spark35.txt Makefile $(TORCH_STAMP) | $(UV)
	test -x $(S35_PY) || $(PYTHON) -m venv $(S35_VENV)
	$(UV_INSTALL) $(S35_PY) -c constraints-spark35.txt $(TORCH_WHEEL) "pyspark[connect]==$(S35_PYSPARK)"
	$(UV_INSTALL) $(S35_PY) -c constraints-spark35.txt -e ".[spark,petastorm,dev]"
	$(UV_DROP_PYSPARK)
	$(S35_PY) -c "import importlib.metadata as m, sys; v = m.version('pyspark'); \
		sys.exit(0 if v == '$(S35_PYSPARK)' else f'installing ringtrain replaced pyspark $(S35_PYSPARK) by {v}: the spark extra must not force a pyspark version')"
	$(S35_PY) -m ringcore._stackcheck
	touch $(S35_STAMP)

test-spark35: $(S35_STAMP)
	$(S35_PY) -m compileall -q $(PY_SOURCES)
	$(S35_PY) -m pytest -p no:cacheprovider $(S35_TESTS)

# Two more Spark versions of the Databricks LTS runtimes, each as a stack's pins with only
# pyspark swapped: pyspark (pure Python and jars) is installed alone, without deps, into
# build/pyspark-<v> and put first on PYTHONPATH, so nothing else of the venv moves.
# Spark 4.1 (runtime 18) over the newest stack's venv: the Connect tests (the runner's
# and the estimator's, a server started from that pyspark); persistence is tested on 4.3
# and 3.5. The newest 3.5.x (runtime 16.4 ships 3.5.2) over the Spark 3.5 venv: the
# runner (local[2]) and persistence.
S41_PYSPARK := 4.1.0
S35_NEWEST_PYSPARK := 3.5.9
S41_TESTS := tests/spark_runner/test_spark_connect.py tests/estimators/test_estimator_connect.py
S35_NEWEST_TESTS := tests/spark_runner/test_spark_runner.py \
	tests/estimators/test_estimator_persistence.py

build/pyspark-%/.installed: | $(UV)
	$(UV_INSTALL) $(PY) --no-deps --target build/pyspark-$* "pyspark==$*"
	$(UV_DROP_PYSPARK)
	touch $@

test-spark41: $(CUR_STAMP) build/pyspark-$(S41_PYSPARK)/.installed
	PYTHONPATH=build/pyspark-$(S41_PYSPARK) $(CUR_PY) -c "import pyspark, sys; \
		sys.exit(0 if pyspark.__version__ == '$(S41_PYSPARK)' else f'pyspark {pyspark.__version__}')"
	PYTHONPATH=build/pyspark-$(S41_PYSPARK) $(CUR_PY) -m pytest -p no:cacheprovider $(S41_TESTS)

test-spark35-newest: $(S35_STAMP) build/pyspark-$(S35_NEWEST_PYSPARK)/.installed
	PYTHONPATH=build/pyspark-$(S35_NEWEST_PYSPARK) $(S35_PY) -c "import pyspark, sys; \
		sys.exit(0 if pyspark.__version__ == '$(S35_NEWEST_PYSPARK)' else f'pyspark {pyspark.__version__}')"
	PYTHONPATH=build/pyspark-$(S35_NEWEST_PYSPARK) $(S35_PY) -m pytest -p no:cacheprovider \
		-k "not local-cluster and not cross_validator" $(S35_NEWEST_TESTS)

# Every benchmark (each writes bench/results/<name>.json with its commit, versions, load,
# checks and targets; see bench/_common.py), then the figures of docs/status.md from those
# JSONs (tools/bench_tables.py), then the device check (bench/gpu_check.sh: its own JSON,
# not quoted in the docs). About 30 min on an idle 2-core machine, and sharded's 350M
# model about 45 min more (17 GB free memory); run it on a quiet
# one. BENCH_ARGS=--quick: small sizes, for a smoke run (about 15 min: the Spark and Ray
# peers' start-up is the floor). A failing script stops the run.
BENCH_SCRIPTS := collectives training torch_backend keras spark_launch estimator ray_trainer shm control_path data_rss \
	sharded
BENCH_ARGS ?=
bench: $(STAMP)
	set -e; for s in $(BENCH_SCRIPTS); do echo "== bench/$$s.py $(BENCH_ARGS)"; \
		$(PY) bench/$$s.py $(BENCH_ARGS); done
	$(PY) bench/control_path.py --stages $(BENCH_ARGS)
	$(PY) tools/bench_tables.py
	PYTHON=$(PY) bench/gpu_check.sh --quick

# The reliability tests (marked @pytest.mark.reliability, see tests/_reliability.py) at
# full size, then RELIABILITY.md from their JUnit report. '-' keeps going on a failure so
# the table shows it; the report script exits non-zero when any test failed.
reliability: $(STAMP)
	mkdir -p build
	-RELIABILITY_LOAD_OPS=10000 RELIABILITY_FITS=20 PYTHONPATH=$(CURDIR):tests $(PY) -m pytest -p no:cacheprovider -p _reliability \
		-m reliability --junitxml=build/reliability.xml tests
	$(PY) bench/reliability_report.py build/reliability.xml RELIABILITY.md

# Elastic training with random faults (SIGKILL, an exception in user code, none), round
# after round for SOAK_MINUTES (default 30), then a table and bench/results/soak.json.
# Not part of make test.
SOAK_MINUTES ?= 30
soak: $(STAMP)
	$(PY) tools/soak.py --minutes $(SOAK_MINUTES)

# Horovod's own parallel suites against ringcore, one test per launch of 2 Gloo ranks,
# through a shim package named horovod built in a temp dir -> docs/conformance.md.
# HOROVOD_SRC: a Horovod checkout or its git directory. Not part of make test.
conformance: $(STAMP)
	@test -n "$(HOROVOD_SRC)" || { echo "make conformance HOROVOD_SRC=<a Horovod checkout or git dir>"; exit 2; }
	$(PY) -m pip install -q -c constraints.txt -e ".[conformance]"
	$(PY) tools/conformance.py --horovod-src "$(HOROVOD_SRC)" $(CONFORMANCE_ARGS)

# Horovod's own examples (tensorflow2, keras, pytorch, elastic, ray) run unchanged through
# the shim -> the examples section of docs/conformance.md (3-5 min on 2 cores). Not part
# of make test.
conformance-examples: $(STAMP)
	@test -n "$(HOROVOD_SRC)" || { echo "make conformance-examples HOROVOD_SRC=<a Horovod checkout or git dir>"; exit 2; }
	$(PY) tools/examples.py --horovod-src "$(HOROVOD_SRC)" $(EXAMPLES_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(CUR_VENV) $(S35_VENV) build *.egg-info

# Hosts made of network namespaces on a bridge (198.18.0.0/24), to try a job across
# hosts by hand (root and `ip netns`); see docs/cluster.md and tools/cluster.py.
cluster-up:
	$(PY) tools/cluster.py up $(CLUSTER_ARGS)

cluster-down:
	$(PY) tools/cluster.py down
