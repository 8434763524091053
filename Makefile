# One command to set up and open the course, one to set up and pass the tests.
# Both create .venv on first use and reinstall only when pyproject.toml changes.

PYTHON ?= python3
# The Pythons TensorFlow publishes stable wheels for; pyproject's requires-python agrees (tested).
PY_OLDEST := 3.10
PY_NEWEST := 3.13
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The settings the tests use: forced CPU simulation, quiet TensorFlow, fixed hashing.
RUN_ENV := TUTORIAL_DEVICE=cpu TF_CPP_MIN_LOG_LEVEL=3 PYTHONHASHSEED=0
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.PHONY: install lab student-lab kernel test unit lessons notebooks bench gpu-check student site clean check-python

install: $(STAMP)

# Exits with a message unless the Python running it is PY_OLDEST..PY_NEWEST (given as arguments).
PY_IN_RANGE := import sys; v = sys.version_info[:2]; \
	lo, hi = (tuple(map(int, a.split("."))) for a in sys.argv[1:]); \
	sys.exit(None if lo <= v <= hi else f"Python {v[0]}.{v[1]} cannot run the course: TensorFlow has \
	stable wheels for Python {sys.argv[1]} to {sys.argv[2]}. Run make PYTHON=python{sys.argv[2]} (or \
	another Python in that range).")
PY_VERSION := import sys; print("%d.%d" % sys.version_info[:2])

$(STAMP): pyproject.toml | check-python
	@$(PYTHON) -c '$(PY_IN_RANGE)' $(PY_OLDEST) $(PY_NEWEST)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[lab,test]"
	mkdir -p $(VENV)/share/jupyter/lab/settings
	cp tools/lab_overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $(STAMP)

# An existing .venv keeps the Python it was made with. When PYTHON is given (on the command
# line or in the environment) and names another version, stop and say how to rebuild, rather
# than silently run the old one. Without PYTHON nothing is checked, so `make test` stays fast.
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

# The folder JupyterLab opens: make lab COURSE_DIR=student/notebooks serves the students' copies.
COURSE_DIR ?= notebooks
# A root_dir (or notebook_dir) given in LAB_ARGS replaces COURSE_DIR: JupyterLab refuses two
# ("root_dir only accepts one value").
LAB_ROOT = $(if $(or $(findstring root_dir,$(LAB_ARGS)),$(findstring notebook_dir,$(LAB_ARGS))),,--ServerApp.root_dir=$(COURSE_DIR))

lab: $(STAMP)
	$(BIN)/jupyter lab $(LAB_ROOT) $(ALLOW_ROOT) $(LAB_ARGS)

# The students' copies (make student), served from this checkout's environment.
student-lab: student
	$(MAKE) lab COURSE_DIR=student/notebooks

# Register .venv as a Jupyter kernel for this user, for a JupyterHub or shared JupyterLab that
# runs from another environment: students pick "$(KERNEL_DISPLAY)" in the kernel menu.
KERNEL_NAME ?= tf-multi-device
KERNEL_DISPLAY ?= Python (tf-multi-device course)
kernel: $(STAMP)
	$(BIN)/python -m ipykernel install --user --name $(KERNEL_NAME) --display-name "$(KERNEL_DISPLAY)"

# Two pytest-xdist workers (TEST_WORKERS=1 for one process): most tests wait on the TensorFlow
# processes and kernels they start. --dist loadfile keeps each file in one worker, in order:
# nbval runs a notebook's cells one after another in one kernel. The notebooks come first: they
# are the longest files, and started last they would leave one worker running alone at the end.
TEST_WORKERS ?= 2
PARALLEL = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(BIN)/ruff check tutorial_lib examples tests notebooks tools conftest.py
	$(BIN)/ruff format --check tutorial_lib examples tests notebooks tools conftest.py
	$(BIN)/python -m pytest $(NOTEBOOKS) tests --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg $(PARALLEL) $(PYTEST_ARGS)

# The quick check after changing the package: the unit tests without those marked slow.
unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(PARALLEL) $(PYTEST_ARGS)

# Rewrite the package's and the examples' copies of the notebooks' lesson code from the notebooks
# (tools/lessons.py; tests/test_lessons.py fails while a copy differs).
lessons: $(STAMP)
	$(BIN)/python tools/lessons.py --write

# Re-run every notebook in place under the test settings, so stored outputs come from a real run,
# then drop TensorFlow's start-up log lines and local paths from them (tools/clean_notebooks.py).
notebooks: $(STAMP)
	$(RUN_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=600 $(NOTEBOOKS)
	$(BIN)/python tools/clean_notebooks.py $(NOTEBOOKS)

# The course's benchmark on this machine: a table, and JSON with BENCH_ARGS="--json bench.json".
bench: $(STAMP)
	$(BIN)/python -m tutorial_lib.bench $(BENCH_ARGS)

# On a machine with 2 or more GPUs: run the take-away files' --check (NCCL, MirroredStrategy) on
# them and print a report to paste into an issue; exits 1 if a run fails. Not under RUN_ENV:
# TUTORIAL_DEVICE=cpu would hide the GPUs. GPU_CHECK_ARGS="--timeout 600" gives each run longer.
gpu-check: $(STAMP)
	$(BIN)/python -m tutorial_lib.gpu_check $(GPU_CHECK_ARGS)

# The hand-out for students: student/ and student.zip (not committed), with the package and the
# notebooks, solution cells emptied into numbered placeholders and outputs cleared.
student:
	$(PYTHON) tools/student_copies.py notebooks student

# The course as a static web site in site/ (not committed): every notebook with its stored
# outputs, solutions removed, the README as the front page. Open site/index.html.
site: $(STAMP)
	$(BIN)/python tools/build_site.py notebooks site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site student student.zip
