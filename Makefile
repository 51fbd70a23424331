# The two commands: `make demo` and `make test`. Each sets up what it needs on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ddtree-installed
TRITON_VENV ?= .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.ddtree-installed
DEMO := out/demo
ENGINE := engines/demo
TP ?= 8
NP ?= $(TP)
MPIRUN := $(VENV)/bin/mpirun
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

.PHONY: demo test lint venv triton-venv serve clean

venv: $(STAMP)
triton-venv: $(TRITON_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU build that lies on this machine's disk (a range would pull a CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[build,run,test]'
	touch $(STAMP)

# Triton's own environment: nvidia-pytriton bundles tritonserver 2.51 and pins numpy<2.
$(TRITON_STAMP):
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q nvidia-pytriton==0.7.0 'tritonclient[http,grpc]'
	touch $(TRITON_STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The tests: one worker a logical core (pytest-xdist; PYTEST_XDIST_AUTO_NUM_WORKERS=N sets N), each file on one
# worker, so its session fixtures (the engines) are built once.
test: lint $(TRITON_STAMP)
	DDTREE_TRITON_VENV=$(TRITON_VENV) $(PY) -m pytest -q -ra -n logical --dist loadfile tests

# Serve the demo engines with a real tritonserver on 127.0.0.1:8000 (HTTP) / 8001 (gRPC); Ctrl-C stops everything.
# SERVE_ARGS: more triton_repo flags, e.g. "--backend torch --max_batch_size 8" (in-flight batching).
SERVE_ARGS ?=
serve: $(STAMP) $(TRITON_STAMP)
	$(PY) -m runner.serving.triton_repo --engine_dir $(ENGINE) --output_dir out/triton/repo --force $(SERVE_ARGS)
	$(PY) -m runner.serving.triton_server --triton_venv $(TRITON_VENV) --model_repository out/triton/repo

# The trained pair (trained/: a small Kimi K2.x-architecture target and its DFlash drafter, trained on Python's
# standard library) -> TP-8 engines -> DDTree under mpirun, then the same prompts autoregressively for comparison.
DEMO_PROMPTS := --input_text "def binary_search(items, target):" --input_text "class LRUCache:" \
	--input_text "def read_config(path):"
demo: $(STAMP)
	$(VENV)/bin/build-engine --model_dir trained/kimi-k2-py --draft_model_dir trained/kimi-k2-py-dflash \
		--tp_size $(TP) --output_dir $(ENGINE) --max_input_len 128 --max_seq_len 512 --ddtree_budget 32 \
		--dtype float32 --force
	$(VENV)/bin/build-engine inspect $(ENGINE) | head -12
	$(MPIRUN) -np $(NP) $(PY) -m runner --engine_dir $(ENGINE) --backend ort --streaming --max_output_len 96 $(DEMO_PROMPTS)
	@echo "--- the same prompts, autoregressive (no drafter): the baseline DDTree's speed is measured against ---"
	$(MPIRUN) -np $(NP) $(PY) -m runner --engine_dir $(ENGINE) --backend ort --max_output_len 96 --autoregressive \
		$(DEMO_PROMPTS) | grep -E '^(mode|\[stats)'

clean:
	rm -rf out $(ENGINE)
