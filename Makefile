# Every target installs what it needs into .venv on first use; later runs
# reinstall only when pyproject.toml changes.
#   make train-symbolic DEVICES=cpu:0,cpu:1 EPOCHS=3
#   make setup MXNET=cu112            # CUDA 11.2 build of MXNet instead of the CPU one
#                                     # (later targets keep it; MXNET=cpu switches back)

PYTHON ?= python3
MXNET ?= $(if $(wildcard .venv/.installed-cu112),cu112,cpu)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(MXNET)

DEVICES ?=
EPOCHS ?=
TRAIN_FLAGS = $(if $(DEVICES),--devices $(DEVICES)) $(if $(EPOCHS),--epochs $(EPOCHS))

.PHONY: help setup train-symbolic train-imperative export compare bench bench-export bench-pipeline test clean

help:
	@echo "make train-symbolic    train the ctx_group graph model-parallel (Module API)"
	@echo "make train-imperative  train the Gluon twin model-parallel"
	@echo "make export            export the symbolic checkpoint to symbol/params and ONNX, verify"
	@echo "make compare           train all variants side by side, write table, plot and graph"
	@echo "make bench             training throughput and time-to-accuracy, as ratios"
	@echo "make bench-export      inference throughput of the exported model: onnxruntime vs MXNet"
	@echo "make bench-pipeline    micro-batch pipelining: overlap and bubble from the trace, memory per device"
	@echo "make test              run the test suite"
	@echo "options: DEVICES=cpu:0,cpu:1,cpu:2 EPOCHS=N MXNET=cpu|cu112 PYTHON=python3.x"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=21.3"
	@# mxnet and mxnet-cu112 install the same module: remove the other build first
	$(PY) -m pip uninstall --quiet --yes $(if $(filter cu112,$(MXNET)),mxnet,mxnet-cu112) 2>/dev/null || true
	$(PY) -m pip install --quiet -e ".[$(MXNET),test]"
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null; } || echo "graphviz 'dot' not installed (needs root/apt): graph pictures will be .dot source only"
	@rm -f $(VENV)/.installed-*
	@touch $@

setup: $(STAMP)

train-symbolic: $(STAMP)
	$(PY) -m mp_symbolic train --variant symbolic $(TRAIN_FLAGS)

train-imperative: $(STAMP)
	$(PY) -m mp_symbolic train --variant imperative $(TRAIN_FLAGS)

export: $(STAMP)
	$(PY) -m export

compare: $(STAMP)
	$(PY) -m mp_symbolic compare $(TRAIN_FLAGS)

bench: $(STAMP)
	$(PY) -m bench

bench-export: export
	$(PY) bench/export_throughput.py

bench-pipeline: $(STAMP)
	$(PY) -m bench.pipeline

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf artifacts .pytest_cache
