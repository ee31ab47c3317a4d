# MiniQLoRA-MoE Labs. Every target creates .venv first if it is missing or out of date.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch's version is pinned in constraints.txt alone; it is read here for the torch-first install.
TORCH := $(shell grep -m1 '^torch==' constraints.txt)
export PATH := $(abspath $(VENV))/bin:$(PATH)

EXP ?= experiments/00-pretrain-base
SUBMISSIONS ?= submissions
LAB ?=
# Extra `jupyter lab` arguments, e.g. LAB_ARGS="--no-browser --port 8890" (as root,
# --allow-root is added for you).
LAB_ARGS ?=
# MODE=instructor shows nbgrader's instructor tools (Formgrader, Create Assignment, Courses);
# learners do not see them.
MODE ?= learner

.PHONY: venv lab test test-fast course grade reproduce run readme times bench-gpu compile-report check-exercises check mine lint lock clean

venv: $(STAMP)

# torch first and pinned, so that nothing later can pull a CUDA build onto a CPU machine.
$(STAMP): pyproject.toml constraints.txt
	@echo "== setting up $(VENV) =="
	@test -n "$(TORCH)" || { echo "constraints.txt has no torch==VERSION line"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $@

lab: $(STAMP)  ## copy each lab to work/ (once; never overwritten), serve JupyterLab [MODE=instructor]
	$(PY) -m labkit lab --mode $(MODE) $(LAB_ARGS)

test: $(STAMP)  ## everything CI runs: lint, unit tests, notebooks pipeline, experiments
	$(VENV)/bin/ruff check src tests solutions experiments benchmarks
	$(PY) -m pytest --durations=15

test-fast: $(STAMP)  ## unit tests only (no notebooks, no experiment re-runs)
	$(PY) -m pytest -m "not notebooks and not slow"

course: $(STAMP)  ## (course developers) solutions/ -> build/course -> labs/; overwrites no edits
	$(PY) -m labkit course

grade: $(STAMP)  ## autograde SUBMISSIONS=dir -> build/grades [GRADE_ARGS="--force --timeout 600"]
	$(PY) -m labkit grade $(SUBMISSIONS) $(GRADE_ARGS)

run: $(STAMP)  ## run an experiment and write its manifest: make run EXP=experiments/NN-name
	$(PY) -m labkit run $(EXP)

reproduce: $(STAMP)  ## re-run and compare: make reproduce EXP=experiments/NN-name
	$(PY) -m labkit reproduce $(EXP)/manifest.json

readme: $(STAMP)  ## README.md's result numbers, regenerated from the experiments' manifests
	$(PY) -m labkit readme

times: $(STAMP)  ## (course developers) run every solution notebook -> labs/runtimes.json + the runtime markers
	$(PY) -m labkit times $(LAB)

compile-report: $(STAMP)  ## compile every Triton kernel for sm_80/sm_90 (no GPU) -> benchmarks/results/compile_report.json
	$(PY) benchmarks/compile_report.py

bench-gpu: $(STAMP)  ## GPU tests + both kernel benchmarks, one run -> benchmarks/results/gpu/<device>.json [BENCH_ARGS=--tiny on a CPU]
	$(PY) benchmarks/bench_gpu.py $(BENCH_ARGS)

check-exercises: $(STAMP)  ## blank each solution region alone; some test must fail (slow)
	$(PY) -m labkit check-exercises $(LAB)

check: $(STAMP)  ## visible tests of your work/NN-name.ipynb (then saves your definitions to work/mine/): make check LAB=NN-name [NOTEBOOK=path]
	$(PY) -m labkit check $(LAB) $(if $(NOTEBOOK),--notebook $(NOTEBOOK))

mine: $(STAMP)  ## which of your saved lab pieces `use("mine")` runs in the capstone
	$(PY) -m labkit mine

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests solutions experiments benchmarks

lock: $(STAMP)  ## re-freeze constraints.txt from the current .venv
	{ echo "# Exact versions the course is tested with (pip freeze of a fresh .venv, CPU machine)."; \
	  echo "# Regenerate with: make lock"; \
	  $(PY) -m pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

clean:
	rm -rf build .pytest_cache .ruff_cache
