# Two commands a new user needs: `make run` (the main job on the embedded engine) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export HF_ENDPOINT := http://127.0.0.1:9

.PHONY: run test install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/pdchaos run campaigns/default.yaml

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/router_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
