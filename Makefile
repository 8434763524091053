# One command to set up and open the course, one to set up and pass the tests: make lab, make test.
# Both create .venv on first use and reinstall only when pyproject.toml changes. The set-up,
# lab, kernel, bench, gpu-check and clean live in course.mk, which the students' hand-out ships
# as its Makefile; this file adds the teacher's targets.

EXTRAS := lab,test
CLEAN_MORE := .pytest_cache .ruff_cache site student student.zip
include course.mk

# The settings the tests use: forced CPU simulation, quiet TensorFlow, fixed hashing.
RUN_ENV := TUTORIAL_DEVICE=cpu TF_CPP_MIN_LOG_LEVEL=3 PYTHONHASHSEED=0
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.PHONY: student-lab test unit lessons notebooks student site

# The students' copies (make student), served from this checkout's environment
# (COURSE_DIR is the folder make lab opens).
student-lab: student
	$(MAKE) lab COURSE_DIR=student/notebooks

# Two pytest-xdist workers (TEST_WORKERS=1 for one process): most tests wait on the TensorFlow
# processes and kernels they start. --dist loadfile keeps each file in one worker, in order:
# nbval runs a notebook's cells one after another in one kernel. The notebooks come first: they
# are the longest files, and started last they would leave one worker running alone at the end.
# Nothing a test builds may leak into the next: `make test TEST_WORKERS=1` runs every file in one
# process, and TEST_FILE_ORDER=reversed (tests/conftest.py) runs the files last to first, so a file
# that leaves state behind (a strategy's keys, a Keras policy, the working folder) fails one of them.
TEST_WORKERS ?= 2
PARALLEL = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

#
# Then the notebooks once more with TensorFlow's oneDNN switched the other way from this run's
# (tools/onednn_flip.py asks TensorFlow which way that is): oneDNN and Eigen round float32
# differently, and a figure printed finer than its check guarantees would fail on a machine of the
# other kind. FLIP_ONEDNN=0 leaves this pass out.
FLIP_ONEDNN ?= 1
NBVAL = --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

test: $(STAMP)
	$(BIN)/ruff check tutorial_lib examples tests notebooks tools conftest.py
	$(BIN)/ruff format --check tutorial_lib examples tests notebooks tools conftest.py
	$(BIN)/python -m pytest $(NOTEBOOKS) tests $(NBVAL) $(PARALLEL) $(PYTEST_ARGS)
ifneq ($(FLIP_ONEDNN),0)
	flip=$$($(BIN)/python tools/onednn_flip.py) && if [ -n "$$flip" ]; then \
		echo "the notebooks again, with TF_ENABLE_ONEDNN_OPTS=$$flip (oneDNN switched the other way)"; \
		TF_ENABLE_ONEDNN_OPTS=$$flip $(BIN)/python -m pytest $(NOTEBOOKS) $(NBVAL) $(PARALLEL) $(PYTEST_ARGS); fi
endif

# The quick check after changing the package: the unit tests without those marked slow.
unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(PARALLEL) $(PYTEST_ARGS)

# Rewrite the package's and the examples' copies of the notebooks' lesson code from the notebooks
# (tools/lessons.py; tests/test_lessons.py fails while a copy differs).
lessons: $(STAMP)
	$(BIN)/python tools/lessons.py --write

# Re-run every notebook in place under the test settings, so stored outputs come from a real run,
# then drop TensorFlow's start-up log lines and local paths from them (tools/clean_notebooks.py), and
# copy the timing cells' quiet runs, with this machine and date, into tutorial_lib/stored_runs.json,
# which a busy student's run prints beside its own (tools/stored_runs.py: it refuses a busy run).
notebooks: $(STAMP)
	$(RUN_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=600 $(NOTEBOOKS)
	$(BIN)/python tools/clean_notebooks.py $(NOTEBOOKS)
	$(BIN)/python tools/stored_runs.py --write $(NOTEBOOKS)

# The hand-out for students: student/ and student.zip (not committed), with the package and the
# notebooks, solution cells emptied into numbered placeholders and outputs cleared.
student:
	$(PYTHON) tools/student_copies.py notebooks student

# The course as a static web site in site/ (not committed): every notebook with its stored
# outputs, solutions removed, the README as the front page. Open site/index.html.
site: $(STAMP)
	$(BIN)/python tools/build_site.py notebooks site
