# Set up the course and open it: make lab. Also: make kernel (for a shared JupyterHub), make bench
# (the course's benchmark), make gpu-check (on a machine with GPUs), make clean (remove .venv).
# The first make lab creates .venv and installs the course into it; later runs reinstall only
# when pyproject.toml changes. The students' hand-out ships this file as its Makefile; the
# teacher's Makefile includes it.

PYTHON ?= python3
# The Pythons TensorFlow publishes stable wheels for; pyproject's requires-python agrees (tested).
PY_OLDEST := 3.10
PY_NEWEST := 3.13
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The extras of pyproject.toml installed into .venv: lab (JupyterLab); the teacher's Makefile adds test.
EXTRAS ?= lab

.PHONY: install lab kernel bench gpu-check clean check-python

install: $(STAMP)

# Exits with a message unless the Python running it is PY_OLDEST..PY_NEWEST (given as arguments).
PY_IN_RANGE := import sys; v = sys.version_info[:2]; \
	lo, hi = (tuple(map(int, a.split("."))) for a in sys.argv[1:]); \
	sys.exit(None if lo <= v <= hi else f"Python {v[0]}.{v[1]} cannot run the course: TensorFlow has \
	stable wheels for Python {sys.argv[1]} to {sys.argv[2]}. Run make PYTHON=python{sys.argv[2]} (or \
	another Python in that range).")
PY_VERSION := import sys; print("%d.%d" % sys.version_info[:2])

# pip is quiet for the minutes it takes (TensorFlow is most of it): say so before it starts.
$(STAMP): pyproject.toml | check-python
	@$(PYTHON) -c '$(PY_IN_RANGE)' $(PY_OLDEST) $(PY_NEWEST)
	@echo "Setting up the course in $(VENV): pip installs TensorFlow and the course with its extras $(EXTRAS)."
	@echo "This takes a few minutes, once, and pip prints nothing until it is done."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	mkdir -p $(VENV)/share/jupyter/lab/settings
	cp tools/lab_overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $(STAMP)
	@echo "The course is set up in $(VENV)."

# An existing .venv keeps the Python it was made with. When PYTHON is given (on the command
# line or in the environment) and names another version, stop and say how to rebuild, rather
# than silently run the old one. Without PYTHON nothing is checked, so later runs stay fast.
check-python:
ifneq ($(filter command line environment,$(origin PYTHON)),)
	@want=$$($(PYTHON) -c '$(PY_VERSION)') || { echo "make: PYTHON=$(PYTHON) does not run" >&2; exit 1; }; \
	if [ -e $(BIN)/python ]; then \
		have=$$($(BIN)/python -c '$(PY_VERSION)' 2>/dev/null || echo "a broken interpreter"); \
		if [ "$$want" != "$$have" ]; then \
			echo "make: $(VENV) runs Python $$have but PYTHON=$(PYTHON) is Python $$want." >&2; \
			echo "  To rebuild $(VENV) with it: make clean, then make PYTHON=$(PYTHON) $(or $(MAKECMDGOALS),install)" >&2; \
			echo "  To keep $(VENV) as it is: leave PYTHON out$(if $(filter environment,$(origin PYTHON)), (it is set in your environment: unset PYTHON))." >&2; \
			exit 1; \
		fi; \
	fi
endif

# JupyterLab refuses to run as root (containers, CI) unless told to.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

# The folder JupyterLab opens.
COURSE_DIR ?= notebooks
# A root_dir (or notebook_dir) given in LAB_ARGS replaces COURSE_DIR: JupyterLab refuses two
# ("root_dir only accepts one value").
LAB_ROOT = $(if $(or $(findstring root_dir,$(LAB_ARGS)),$(findstring notebook_dir,$(LAB_ARGS))),,--ServerApp.root_dir=$(COURSE_DIR))

lab: $(STAMP)
	$(BIN)/jupyter lab $(LAB_ROOT) $(ALLOW_ROOT) $(LAB_ARGS)

# Register .venv as a Jupyter kernel for this user, for a JupyterHub or shared JupyterLab that
# runs from another environment: students pick "$(KERNEL_DISPLAY)" in the kernel menu.
KERNEL_NAME ?= tf-multi-device
KERNEL_DISPLAY ?= Python (tf-multi-device course)
kernel: $(STAMP)
	$(BIN)/python -m ipykernel install --user --name $(KERNEL_NAME) --display-name "$(KERNEL_DISPLAY)"

# The course's benchmark on this machine: a table, and JSON with BENCH_ARGS="--json bench.json".
bench: $(STAMP)
	$(BIN)/python -m tutorial_lib.bench $(BENCH_ARGS)

# On a machine with 2 or more GPUs: run the take-away files' --check (NCCL, MirroredStrategy) on
# them and print a report to paste into an issue; exits 1 if a run fails. TUTORIAL_DEVICE=cpu
# would hide the GPUs. GPU_CHECK_ARGS="--timeout 600" gives each run longer.
gpu-check: $(STAMP)
	$(BIN)/python -m tutorial_lib.gpu_check $(GPU_CHECK_ARGS)

# CLEAN_MORE: what the teacher's Makefile also removes (caches, site/, student/).
clean:
	rm -rf $(VENV) $(CLEAN_MORE)
