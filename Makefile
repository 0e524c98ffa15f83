# Two commands on a fresh machine: `make demo` (the main job) and `make test`
# (`make tools` first installs the tools that the deploy tests check against; .ci/run does).
# Each creates .venv and installs what it needs into it. While working: `make test-fast`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# what make test-fast runs: the tests in none of the tiers (tests/tiers.py says which test is in which)
FAST := not processes and not realworld and not deploy and not slow
# pytest-xdist workers of make test-fast (`make test-fast WORKERS=auto` on a bigger machine)
WORKERS ?= 2

.PHONY: demo test test-fast test-torch-newest lint docs bench tools clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,lightning,realworld,plot,docs]'
	$(PY) -m pip install --quiet --no-deps -c constraints.txt timm  # without torchvision (pyproject.toml says why)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nanguard demo

# the whole suite, serially (torchrun jobs take both cores), after the lint: what CI runs
test: lint
	$(PY) -m pytest -q

# under a minute on two cores: the tests that start no process, need no third-party framework nor
# deploy tool, and take no seconds each
test-fast: lint
	$(PY) -m pytest -q -n $(WORKERS) -m "$(FAST)"

# the unit tier (test-fast's) on the newest torch this machine's pip has, in a venv of its own
# (pyproject.toml's floor is the torch that make test runs); on x86_64 that release is a CUDA build,
# 5.5 GB, which pip takes from this machine's disk and which runs on the CPU
TORCH_NEWEST ?= 2.14.1
NEWEST := .venv-torch-newest
$(NEWEST)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	sed 's/^torch==.*/torch==$(TORCH_NEWEST)/' constraints.txt > $(NEWEST)/constraints.txt
	$(NEWEST)/bin/python -m pip install --quiet -c $(NEWEST)/constraints.txt -e '.[test]'
	touch $@

test-torch-newest: $(NEWEST)/.installed
	$(NEWEST)/bin/python -c 'import torch; print("torch", torch.__version__)'
	$(NEWEST)/bin/python -m pytest -q -n $(WORKERS) -m "$(FAST)" -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check

# Debian's prometheus, alertmanager and shellcheck, which the deploy tests run (root, apt-get)
tools:
	.ci/install-tools

# the documentation site (mkdocs-material) into site/; --strict fails on a dead link or page
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) $(NEWEST) nanguard-incidents nanguard-demo .pytest_cache
