# Rekindle: every entry point a developer or CI needs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

REPO        := $(CURDIR)
# .venv: this checkout, installed editable, over the shared deps env (scripts/python-env).
VENV        := $(shell scripts/python-env --path)
DEPS_VENV   := $(shell scripts/python-env --deps-path)
PY          := $(VENV)/bin/python
K8S_BIN     := $(shell . scripts/lib/common.sh && echo $$REKINDLE_CACHE/kubernetes-$$K8S_VERSION/bin)
export KUBECONFIG := $(shell scripts/local-cluster kubeconfig)
export PATH       := $(VENV)/bin:$(DEPS_VENV)/bin:$(K8S_BIN):$(PATH)
# Every suite prints its slowest tests (the budget of `make test` is watched by them).
PYTEST      := $(PY) -m pytest --durations=25 --durations-min=1
# What a suite needs that make does not install, checked first: names all that is missing.
PREFLIGHT   := python3 -P scripts/rekindle_dev/testenv.py
FAST        := not cluster and not criu and not vllm and not packaging and not store

.PHONY: help env lint fmt typecheck test test-preflight test-unit test-packaging test-criu \
        test-vllm test-cluster \
        cluster-up cluster-down cluster-status images image-gpu-rootfs demo clean-cache

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

env: ## build (or reuse) the Python env and install this checkout into .venv (editable)
	@scripts/python-env >/dev/null

lint: env ## ruff (lint + format check), mypy, the import contracts (import-linter), helm lint --strict, helm package
	ruff check .
	ruff format --check .
	$(PY) -m mypy
	$(PY) -c 'import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())' --no-cache
	scripts/build-kubernetes >/dev/null  # the pinned helm
	helm lint --strict charts/rekindle
	d=$$(mktemp -d) && helm package charts/rekindle -d "$$d" >/dev/null && rm -rf "$$d"

fmt: env ## format and autofix with ruff
	ruff format .
	ruff check --fix .

test: test-preflight lint test-unit test-packaging test-store test-criu test-vllm test-cluster ## everything: lint, unit, packaging, object store, CRIU, vLLM and cluster suites

test-preflight: ## what every suite needs from this machine (and make does not install), checked at once
	$(PREFLIGHT) unit packaging store criu vllm cluster

preflight-%:
	$(PREFLIGHT) $*

test-unit: preflight-unit env ## fast tests: no servers; root for a few (mounts, chattr +i); gpu ones skip without CUDA
	scripts/build-kubernetes >/dev/null  # the pinned helm, for the chart template tests
	$(PYTEST) -m "$(FAST)"

test-packaging: preflight-packaging env ## pip install '.[operator]' into a clean venv: kubectl-rekindle and --plot work
	$(PYTEST) -m packaging

test-store: preflight-store env ## a real S3-compatible server (SeaweedFS) on loopback: publish, verified ranged pulls, resume; builds it on a cache miss
	scripts/build-seaweedfs >/dev/null
	$(PYTEST) -m store

test-criu: preflight-criu env ## real CRIU dump/restore (root); builds CRIU on a cache miss
	scripts/build-criu >/dev/null
	$(PYTEST) -m "criu and not vllm"

test-vllm: preflight-vllm env ## real vLLM CPU server: agent, weight reloader, a real router in front
	scripts/build-criu >/dev/null
	scripts/build-vllm-router >/dev/null
	$(PYTEST) -m vllm

test-cluster: preflight-cluster env cluster-up images ## the real local cluster: node, operator, chart
	$(PYTEST) -m cluster

cluster-up: ## start the embedded local Kubernetes cluster, two nodes (idempotent)
	scripts/local-cluster up --nodes 2

cluster-down: ## stop it (only what cluster-up started)
	scripts/local-cluster down

cluster-status: ## components, node state, kubeconfig path
	scripts/local-cluster status

images: cluster-up ## build the local images (smoke, runtime-cpu, operator, object-store, keda) and load them into the node
	for image in smoke runtime-cpu operator object-store keda; do
		scripts/local-cluster load-image "$$(scripts/build-image $$image)"
	done

image-gpu-rootfs: env ## the GPU runtime image's root filesystem, built locally (not in CI: GB of CUDA wheels; never run on a GPU)
	images/runtime-gpu/build-rootfs
	REKINDLE_GPU_ROOTFS_BUILT=1 $(PYTEST) tests/unit/test_gpu_image.py::test_a_built_root_filesystem_has_every_part

demo: env cluster-up images ## the main job, end to end, on the local cluster
	scripts/demo

clean-cache: ## forget every cached build (Kubernetes, CRIU, Python env, images)
	rm -rf $${REKINDLE_CACHE:-$$HOME/.cache/rekindle}
