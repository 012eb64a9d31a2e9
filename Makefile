# The two commands a new user needs:  `make demo`  and  `make test`.
# Each creates (or reuses) .venv in the repo and installs what it needs:
# the CPU build of torch first (a plain `torch` would pull a multi-GB CUDA build),
# then mmcache itself with its dev extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mmcache-installed

.PHONY: demo test lint typecheck docs unit bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mmcache demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/deptry src

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site (docs/, mkdocs.yml), built strictly: a broken link, anchor or API
# reference fails. Its code blocks run in the unit tests (tests/unit/test_docs_examples.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

unit: $(STAMP)
	MMCACHE_TEST_SHM_STRICT=1 $(PY) -m pytest -q

test: lint typecheck docs unit

bench: $(STAMP)
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf $(VENV) build site *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
