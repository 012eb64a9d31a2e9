# The two commands a new user needs:  `make demo`  and  `make test`.
# Each creates (or reuses) .venv in the repo and installs what it needs:
# the CPU build of torch first (a plain `torch` would pull a multi-GB CUDA build),
# then mmcache itself with its dev extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mmcache-installed

.PHONY: demo test lint typecheck docs unit reference ref-env bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

# The reference environment: open_clip, torchvision, transformers, accelerate and lightning at the
# pinned releases of tests/reference/requirements.txt, with mmcache installed from this checkout.
# Separate from .venv because torchvision needs the (CUDA) torch it was built for; it runs on CPU.
REF_VENV ?= .venv-ref
REF_PY := $(REF_VENV)/bin/python
REF_STAMP := $(REF_VENV)/.mmcache-ref-installed

$(REF_STAMP): tests/reference/requirements.txt pyproject.toml
	test -x $(REF_PY) || $(PYTHON) -m venv $(REF_VENV)
	$(REF_PY) -m pip install -q --upgrade pip
	$(REF_PY) -m pip install -q -r tests/reference/requirements.txt
	$(REF_PY) -m pip install -q -e '.[testing,hf,chat,video,plot]' pytest-timeout
	touch $(REF_STAMP)

ref-env: $(REF_STAMP)

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

# The parity tests against the real libraries, under the reference venv (tests/reference).
reference: $(REF_STAMP)
	MMCACHE_REF_ENV=1 $(REF_PY) -m pytest -q tests/reference

test: lint typecheck docs unit reference

bench: $(STAMP)
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf $(VENV) $(REF_VENV) build site *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
