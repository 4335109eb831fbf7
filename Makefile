# Every target installs what it needs into .venv on first use; later runs
# reinstall only when pyproject.toml or the package sources change. Python 3.8 to 3.11 (MXNet 1.9.1's
# wheels); pick one with PYTHON=, e.g. `make test PYTHON=python3.11`.
#   make train-symbolic DEVICES=cpu:0,cpu:1 EPOCHS=3 CHUNKS=4
#   make setup MXNET=cu112            # CUDA 11.2 build of MXNet instead of the CPU one
#                                     # (later targets keep it; MXNET=cpu switches back)

PYTHON ?= python3
MXNET ?= $(if $(wildcard .venv/.installed-cu112),cu112,cpu)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(MXNET)
# torch, the node processes' transport (pyproject.toml's `nodes` extra pins the same
# release): installed apart, in $(VENV)/torch-site, because GluonCV 0.10 refuses to
# import wherever torch 2 is importable (dmlc/gluon-cv#1768); mp_symbolic/core/transport/nodes.py
# looks there.
TORCH := torch==2.13.0
TORCH_STAMP := $(VENV)/torch-site/.installed-$(TORCH)

DEVICES ?=
EPOCHS ?=
CHUNKS ?=
QUICK ?=
TRAIN_FLAGS = $(if $(DEVICES),--devices $(DEVICES)) $(if $(EPOCHS),--epochs $(EPOCHS))
RUN_FLAGS = $(TRAIN_FLAGS) $(if $(CHUNKS),--chunks $(CHUNKS))
SUPPORTED = import sys; sys.exit(not (3, 8) <= sys.version_info[:2] <= (3, 11))

.PHONY: help setup train-symbolic train-imperative train-digits train-lm export-lm sample-lm \
        export export-digits compare \
        bench bench-export bench-dist bench-pipeline bench-tp bench-lm bench-nodes bench-blas bench-peer bench-plan \
        bench-commit test test-slow test-all clean distclean

help:
	@echo "make train-symbolic    train the regression model-parallel (Pipeline + MXNet Module)"
	@echo "make train-imperative  train the regression's Gluon twin model-parallel"
	@echo "make train-digits      train a CNN on scikit-learn's 8x8 digits over three devices"
	@echo "make train-lm          train a character-level GPT on the Python standard library (docs/lm.md)"
	@echo "make export-lm         export it to symbol/params and ONNX (dynamic batch and sequence), verify"
	@echo "make sample-lm         sample text from it (PROMPT='def ')"
	@echo "make export            export the regression checkpoint to symbol/params and ONNX, verify"
	@echo "make export-digits     export the digits checkpoint the same way"
	@echo "make compare           train all variants side by side, write table, plot and graph"
	@echo "make bench             training throughput and time-to-accuracy, as ratios"
	@echo "make bench-export      inference throughput of the exported model: onnxruntime vs MXNet"
	@echo "make bench-dist        a dist_sync job of 1 and 2 workers on loopback (launch overhead)"
	@echo "make bench-pipeline    micro-batch pipelining: overlap and bubble from the trace, memory per device"
	@echo "make bench-tp          tensor-parallel MLP block: memory per device and step time at 1, 2, 4 shards"
	@echo "make bench-lm          the language model on 1, 2, 4 tensor-parallel shards: memory per device, step time, tokens/s and MFU;"
	@echo "                       then its norm, attention and Adam update on each candidate op, one thread"
	@echo "make bench-nodes       the language model on 2 node processes against 2 devices of one process: step time, bytes sent, memory;"
	@echo "                       then each node's peak resident memory beside one process's (an MLP of 805 MB: train, commit, report, resume)"
	@echo "make bench-blas        OpenBLAS at the CPU's own kernel against its own choice: dot, batch_dot, every task"
	@echo "make bench-peer        the language model's step against PyTorch's on the same GPT: one process, and 2 processes 1F1B against torch.distributed.pipelining"
	@echo "make bench-commit      a checkpoint commit over 2 node processes: time, bytes each node writes, memory"
	@echo "make bench-plan        the planner's pick (plan='auto') against every plan it scored, trained: gap, Kendall's tau, peak memory"
	@echo "make test              run the test suite, less the tests marked slow (about 5 minutes on 2 cores)"
	@echo "make test-slow         run only the tests marked slow: most node and dist_sync jobs, fresh-process memory,"
	@echo "                       the docs' walkthroughs, benchmarks' quick runs (about 6 minutes on 2 cores)"
	@echo "make test-all          run both"
	@echo "make clean             remove artifacts/ (distclean: .venv too)"
	@echo "options: DEVICES=cpu:0,cpu:1,cpu:2 EPOCHS=N CHUNKS=M MXNET=cpu|cu112 PYTHON=python3.x QUICK=1"

# The project is installed as a copy (see the pip line): reinstalled when its sources change.
SOURCES := $(wildcard mp_symbolic/*.py mp_symbolic/*/*.py mp_symbolic/*/*/*.py export/*.py)

$(STAMP): pyproject.toml $(SOURCES)
	@# a .venv made by a Python MXNet 1.9.1 cannot run (3.12+, or older than 3.8) is made anew
	@if [ -x $(PY) ] && ! $(PY) -c '$(SUPPORTED)'; then \
	  echo "$(VENV) uses $$($(PY) -V 2>&1), which MXNet 1.9.1 does not support: recreating it with $(PYTHON)"; \
	  rm -rf $(VENV); fi
	@$(PYTHON) -c '$(SUPPORTED)' || { echo "error: PYTHON=$(PYTHON) is $$($(PYTHON) -V 2>&1); expected Python 3.8 to 3.11 (MXNet 1.9.1's wheels), e.g. make PYTHON=python3.11"; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=21.3"
	@# mxnet and mxnet-cu112 install the same module: remove the other build first
	$(PY) -m pip uninstall --quiet --yes $(if $(filter cu112,$(MXNET)),mxnet,mxnet-cu112) 2>/dev/null || true
	@# not editable: setuptools prints a warning banner for editable installs; commands run
	@# from this folder import the package from here anyway
	$(PY) -m pip install --quiet ".[$(MXNET),test]"
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null; } || echo "graphviz 'dot' not installed (needs root/apt): graph pictures will be .dot source only"
	@rm -f $(VENV)/.installed-*
	@touch $@

$(TORCH_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet --upgrade --target $(VENV)/torch-site "$(TORCH)"
	@touch $@

setup: $(STAMP) $(TORCH_STAMP)

train-symbolic: $(STAMP)
	$(PY) -m mp_symbolic train --variant symbolic $(RUN_FLAGS)

train-imperative: $(STAMP)
	$(PY) -m mp_symbolic train --variant imperative $(TRAIN_FLAGS)

train-digits: $(STAMP)
	$(PY) -m mp_symbolic train --task digits $(RUN_FLAGS)

# The language model's two stages: the token embedding on the first, the output
# layer that reads it on the second (a tied weight across devices).
LM_DEVICES := cpu:0,cpu:1
LM_TRAIN = $(PY) -m mp_symbolic train --task lm --devices $(or $(DEVICES),$(LM_DEVICES)) \
	$(if $(EPOCHS),--epochs $(EPOCHS)) $(if $(CHUNKS),--chunks $(CHUNKS))
PROMPT ?= def

train-lm: $(STAMP)
	$(LM_TRAIN)

export-lm: $(STAMP)
	@test -e artifacts/lm/current || $(LM_TRAIN) --no-progress
	$(PY) -m export --checkpoint artifacts/lm --out artifacts/export-lm --dynamic 1=seq

sample-lm: $(STAMP)
	@test -e artifacts/lm/current || $(LM_TRAIN) --no-progress
	$(PY) -m mp_symbolic.training.sample --checkpoint artifacts/lm --prompt '$(PROMPT) ' --length 300

# Export never trains: these targets train first when there is no checkpoint yet.
export: $(STAMP)
	@test -e artifacts/symbolic/current || $(PY) -m mp_symbolic train --variant symbolic --no-progress
	$(PY) -m export

export-digits: $(STAMP)
	@test -e artifacts/digits/current || $(PY) -m mp_symbolic train --task digits --no-progress
	$(PY) -m export --checkpoint artifacts/digits --out artifacts/export-digits

compare: $(STAMP)
	$(PY) -m mp_symbolic compare $(TRAIN_FLAGS)

# QUICK=1: a smoke run of a benchmark (few repeats; its figures mean little)
bench: $(STAMP)
	$(PY) -m bench $(if $(QUICK),--quick)

bench-export: export
	$(PY) bench/export_throughput.py $(if $(QUICK),--repeats 1 --repeat-seconds 0.02)

bench-dist: $(STAMP)
	$(PY) -m bench.dist $(if $(QUICK),--repeats 1 --steps 20 --warmup 2)

bench-pipeline: $(STAMP)
	$(PY) -m bench.pipeline $(if $(QUICK),--quick)

bench-tp: $(STAMP)
	$(PY) -m bench.tensor_parallel $(if $(QUICK),--quick)

bench-lm: $(STAMP)
	$(PY) -m bench.lm $(if $(QUICK),--quick)
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m bench.lm_ops $(if $(QUICK),--quick)

bench-nodes: $(STAMP) $(TORCH_STAMP)
	$(PY) -m bench.nodes $(if $(QUICK),--quick)
	$(PY) -m bench.nodes --memory $(if $(QUICK),--quick)

bench-blas: $(STAMP)
	$(PY) -m bench.blas $(if $(QUICK),--quick)

bench-peer: $(STAMP) $(TORCH_STAMP)
	$(PY) -m bench.peer $(if $(QUICK),--quick)

bench-commit: $(STAMP) $(TORCH_STAMP)
	$(PY) -m bench.commit

bench-plan: $(STAMP)
	$(PY) -m bench.plan $(if $(QUICK),--quick)

# one pytest worker per core, each test file on one worker: a file's module fixtures
# (a trained run, an export) are made once, not once per worker; files in the order
# tests/conftest.py gives them (the heaviest first). `make test` leaves out the tests
# marked slow (pyproject.toml's `slow`); `make test-slow` runs only them, `make test-all`
# everything, and .ci/run both halves. A worker that crashes (a signal in MXNet) is not
# replaced: pytest-xdist 3.8's loadfile scheduling can wait forever for a replacement
# (pytest-dev/pytest-xdist#784); the run fails at once, naming the test.
PYTEST = $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15 \
	--max-worker-restart=0
test: $(STAMP) $(TORCH_STAMP)
	$(PYTEST) -m 'not slow'

test-slow: $(STAMP) $(TORCH_STAMP)
	$(PYTEST) -m slow

test-all: $(STAMP) $(TORCH_STAMP)
	$(PYTEST)

clean:
	rm -rf artifacts .pytest_cache

distclean: clean
	rm -rf $(VENV) *.egg-info
