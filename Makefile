# Quick start: `make run` (set up, fetch the default model, generate) and `make test` (set up, run the tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test install model bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing can pull a CUDA build in its place.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Fetch the default model and compile the CPU attention kernel ahead of the first engine start.
model: install
	$(PY) -m pagellm.model_executor.default_model
	$(PY) -m pagellm.model_executor.layers.cpu_attention

run: model
	$(VENV)/bin/pagellm generate --chat --max-tokens 48 \
		"What is the capital of France?" \
		"Write a haiku about paged memory." \
		"Explain continuous batching in one sentence."

test: model
	$(PY) -m pytest -q

bench: model
	$(VENV)/bin/pagellm bench throughput --workload ../shared/workloads/workload_64.json --dtype bfloat16

clean:
	rm -rf $(VENV) .pytest_cache
