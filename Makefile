# One command to set up and open the course, one to set up and pass the tests.
# Both create .venv on first use and reinstall only when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The settings the tests use: forced CPU simulation, quiet TensorFlow, fixed hashing.
RUN_ENV := TUTORIAL_DEVICE=cpu TF_CPP_MIN_LOG_LEVEL=3 PYTHONHASHSEED=0
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.PHONY: install lab test unit notebooks bench student clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else \
		"Python 3.10 or newer is needed; run make PYTHON=python3.x")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[lab,test]"
	touch $(STAMP)

# JupyterLab refuses to run as root (containers, CI) unless told to.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=notebooks $(ALLOW_ROOT) $(LAB_ARGS)

test: $(STAMP)
	$(BIN)/ruff check tutorial_lib tests notebooks tools
	$(BIN)/python -m pytest tests $(NOTEBOOKS) --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg $(PYTEST_ARGS)

unit: $(STAMP)
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

# Re-run every notebook in place under the test settings, so stored outputs come from a real run.
notebooks: $(STAMP)
	$(RUN_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=600 $(NOTEBOOKS)

# The course's benchmark on this machine: a table, and JSON with BENCH_ARGS="--json bench.json".
bench: $(STAMP)
	$(BIN)/python -m tutorial_lib.bench $(BENCH_ARGS)

# Copies for students: solution cells emptied, outputs cleared (in student/, not committed).
student:
	$(PYTHON) tools/student_copies.py notebooks student

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
