# Both entry points create .venv and (re)install the project when it is missing or older than the
# files that define it, so a fresh clone needs nothing but Python 3.10+.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: bench bench-quick test test-slow env clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

bench: $(STAMP)
	$(BIN)/turbotrain bench --workload gpt --out bench-out

bench-quick: $(STAMP)
	$(BIN)/turbotrain bench --workload gpt --quick --out bench-out/quick

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q

env: $(STAMP)
	$(BIN)/turbotrain env

clean:
	rm -rf $(VENV) bench-out
