# Set-up and entry points. `make run` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned: a looser requirement would pull a multi-GB CUDA build
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

run: $(STAMP)
	$(PY) examples/train.py

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/pip install -q -e '.[bench]'
	$(PY) bench/compare.py
	$(PY) bench/train_overhead.py
	$(PY) bench/files_per_tag.py
	$(PY) bench/skeleton.py
	$(PY) bench/restore.py
	$(PY) bench/tiers.py

clean:
	rm -rf $(VENV) build *.egg-info
