# MiniQLoRA-MoE Labs. Every target creates .venv first if it is missing or out of date.
# Without make (Windows): each target's `python -m course|labkit ...` twin is in the README.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
# INSTALLER=uv|pip (default: uv when it is on PATH); TORCH=cpu takes torch from PyTorch's
# CPU-only index (smaller than the CUDA build PyPI serves on Linux), TORCH=cuda PyPI's build;
# the default is cpu on Linux without an NVIDIA GPU. See scripts/venv.py.
INSTALLER ?= auto
TORCH ?= auto
ifeq ($(OS),Windows_NT)
BIN := $(VENV)/Scripts
else
BIN := $(VENV)/bin
endif
PY := $(BIN)/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)

EXP ?= experiments/00-pretrain-base
SUBMISSIONS ?= submissions
LAB ?=
# pytest processes `make test` runs the suite on (pytest-xdist; each test module stays on one).
WORKERS ?= 2
# Extra `jupyter lab` arguments, e.g. LAB_ARGS="--no-browser --port 8890" (as root,
# --allow-root is added for you).
LAB_ARGS ?=
# MODE=instructor shows nbgrader's instructor tools (Formgrader, Create Assignment, Courses);
# learners do not see them.
MODE ?= learner

.PHONY: venv lab test test-fast course grade edition reproduce run readme times bench-cpu bench-gpu device-check device-wheels compile-report check-exercises check-mistakes check mine lint lock clean

venv: $(STAMP)

$(STAMP): pyproject.toml uv.lock constraints.txt scripts/venv.py
	$(PYTHON) scripts/venv.py --installer $(INSTALLER) --torch $(TORCH) --venv $(VENV)

lab: $(STAMP)  ## copy each lab to work/ (once; never overwritten), serve JupyterLab [MODE=instructor]
	$(PY) -m course lab --mode $(MODE) $(LAB_ARGS)

test: $(STAMP)  ## everything CI runs: lint, unit tests, notebooks pipeline, experiments [WORKERS=2]
	$(PY) -m ruff check src tests solutions experiments benchmarks
	$(PY) -m pytest -n $(WORKERS) --dist loadscope --durations=15

test-fast: $(STAMP)  ## unit tests only (no notebooks, no experiment re-runs)
	$(PY) -m pytest -m "not notebooks and not slow"

course: $(STAMP)  ## (course developers) solutions/ -> build/course -> labs/; overwrites no edits
	$(PY) -m course build

grade: $(STAMP)  ## autograde SUBMISSIONS=dir -> build/grades [GRADE_ARGS="--force --timeout 600"]
	$(PY) -m course grade $(SUBMISSIONS) $(GRADE_ARGS)

edition: $(STAMP)  ## (instructors) the student repository, references of labs after THROUGH stubbed: make edition OUT=dir [THROUGH=NN]
	$(PY) -m course edition $(OUT) $(if $(THROUGH),--through $(THROUGH))

run: $(STAMP)  ## run an experiment and write its manifest: make run EXP=experiments/NN-name
	$(PY) -m labkit run $(EXP)

reproduce: $(STAMP)  ## re-run and compare: make reproduce EXP=experiments/NN-name
	$(PY) -m labkit reproduce $(EXP)/manifest.json

readme: $(STAMP)  ## RESULTS.md's numbers and experiments/README.md's reproduce table, regenerated from the manifests
	$(PY) -m labkit readme

times: $(STAMP)  ## (course developers) run every solution notebook -> labs/runtimes.json + the runtime markers
	$(PY) -m course times $(LAB)

compile-report: $(STAMP)  ## compile every Triton kernel for sm_75/80/86/89/90 (no GPU) -> benchmarks/results/compile_report.json
	$(PY) benchmarks/compile_report.py

bench-cpu: $(STAMP)  ## CPU hot paths vs bitsandbytes, PEFT, transformers, log_softmax: ratios, one run -> benchmarks/results/cpu.json
	$(PY) benchmarks/bench_cpu.py $(BENCH_ARGS)

bench-gpu: $(STAMP)  ## GPU tests + both kernel benchmarks, one run -> benchmarks/results/gpu/<device>.json [BENCH_ARGS=--tiny on a CPU]
	$(PY) benchmarks/bench_gpu.py $(BENCH_ARGS)

# No venv: a lent GPU machine has a system Python with torch and triton, and no network.
device-check: PY := python3
device-check:  ## (lent GPU machine) GPU tests + dequant, MoE, log-prob benchmarks, one bounded run -> benchmarks/results/gpu/<device>.json and $$OUT [PY=python3 COMMIT=hash DEVICE_ARGS=--tiny]
	PYTHONUNBUFFERED=1 PYTHONPATH=src$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY) benchmarks/device_check.py $(if $(COMMIT),--commit $(COMMIT)) $(DEVICE_ARGS)

device-wheels: $(STAMP)  ## (here, before a device call) the wheels a lent GPU machine lacks (bitsandbytes) -> build/device-wheels, to carry
	$(PY) benchmarks/carried_wheels.py

check-exercises: $(STAMP)  ## blank each solution region alone; some test must fail (slow)
	$(PY) -m course check-exercises $(LAB)

check-mistakes: $(STAMP)  ## each catalogued learner mistake (solutions/mistakes/) must fail a visible test naming its rule [LAB=NN-name JOBS=2 WRITE=1]
	$(PY) -m course check-mistakes --jobs $(or $(JOBS),1) $(if $(WRITE),--write) $(LAB)

check: $(STAMP)  ## visible tests of your work/NN-name.ipynb (then saves your definitions to work/mine/): make check LAB=NN-name [NOTEBOOK=path]
	$(PY) -m course check $(LAB) $(if $(NOTEBOOK),--notebook $(NOTEBOOK))

mine: $(STAMP)  ## which of your saved lab pieces `use("mine")` runs in the capstone
	$(PY) -m course mine

lint: $(STAMP)
	$(PY) -m ruff check src tests solutions experiments benchmarks

lock: $(STAMP)  ## (course developers) re-resolve uv.lock from PyPI and export it to constraints.txt
	$(PY) -m uv lock --no-config
	{ echo "# pip's view of uv.lock: the exact versions of every platform, with markers (uv export)."; \
	  echo "# Regenerate with: make lock"; \
	  $(PY) -m uv export --no-config --frozen --extra dev --no-hashes --no-emit-project \
	    --no-header --no-annotate; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

clean:
	rm -rf build .pytest_cache .ruff_cache
