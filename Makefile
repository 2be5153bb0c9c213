# Quick start: `make demo` runs agent + collector + dashboard on a generated demo model;
# `make test` runs the whole test suite. Both set up .venv on first use.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test system-packages

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .
	touch $@

# The Cache page's policy comparison: every policy replayed once on held-out real routing traces.
data/.policies-compared: $(STAMP) agent/policies/weights/flashmoe.safetensors
	mkdir -p data
	$(BIN)/flashmoe-cli simulate --capacity 0.25 --db data/flashmoe.db --trace \
	  tests/data/traces/olmoe_math.jsonl tests/data/traces/olmoe_dialogue.jsonl tests/data/traces/qwen_dialogue.jsonl
	touch $@

demo: $(STAMP) data/.policies-compared
	$(BIN)/flashmoe-cli init-demo --out data/demo
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m agent.run_procfile $(BIN)/honcho start

system-packages:
	@bash .ci/system-packages

test: $(STAMP) system-packages
	$(BIN)/python -m pytest -p no:cacheprovider
