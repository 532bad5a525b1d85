# Set-up and entry points. `make run` and `make test` work on a fresh machine.
VENV ?= .venv
# The torch to install first, and the index to take it from. Left empty, pip's configured index is used
# (on the CI machines its torch==2.13.0 is already a CPU build). Elsewhere the public index's default
# torch wheel is a multi-GB CUDA build: `make TORCH_INDEX=https://download.pytorch.org/whl/cpu test`
# takes the CPU wheel instead.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, so that installing the package keeps it rather than resolving one of its own
	$(VENV)/bin/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

run: $(STAMP)
	$(PY) examples/train.py

test: $(STAMP)
	# one line per test file with its count and percentage done, then the skips and failures (-ra)
	$(PY) -m pytest -o console_output_style=count -ra --durations=15 tests; rc=$$?; \
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
