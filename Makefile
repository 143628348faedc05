# Quick start: `make run` (set up, fetch the default model, generate) and `make test` (set up, run the tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run generate test test-avx2 test-zen4 install model bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing can pull a CUDA build in its place.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Fetch the default model and compile the CPU kernels ahead of the first engine start.
model: install
	$(PY) -m pagellm.model_executor.default_model
	$(PY) -m pagellm.model_executor.layers.cpu_kernels

# The main job: the OpenAI-compatible server on 127.0.0.1:8000 (Ctrl-C to stop).
run: model
	@echo "Starting pagellm on http://127.0.0.1:8000/v1 — once it is up, from another shell:"
	@echo "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
	@echo "  or any OpenAI client with base_url=http://127.0.0.1:8000/v1"
	$(VENV)/bin/pagellm serve

generate: model
	$(VENV)/bin/pagellm generate --chat --max-tokens 48 \
		"What is the capital of France?" \
		"Write a haiku about paged memory." \
		"Explain continuous batching in one sentence."

test: model
	$(PY) -m pytest -q

# The suite again with the CPU kernels built for another CPU kind (PAGELLM_CPU_MARCH), on a machine that can run
# that kind's instructions, so its paths are tested where its own CPU is not at hand (.ci/run picks):
#   test-avx2: AVX2 and FMA without AVX-512 (-march=haswell), the AVX2 kind's paths;
#   test-zen4: AVX-512 with BF16 and VNNI but neither AMX nor FP16, on BF16 dot products (-march=cooperlake,
#              PAGELLM_FMA_DOT=1), the Zen 4 kind's paths.
test-avx2: model
	PAGELLM_CPU_MARCH=haswell $(PY) -m pytest -q

test-zen4: model
	PAGELLM_CPU_MARCH=cooperlake PAGELLM_FMA_DOT=1 $(PY) -m pytest -q

bench: model
	$(VENV)/bin/pagellm bench throughput --workload ../shared/workloads/workload_64.json --dtype bfloat16

clean:
	rm -rf $(VENV) .pytest_cache
