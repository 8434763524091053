"""Plumbing for the multi-device TensorFlow course; each module is one idea.

Import modules by name (``from tutorial_lib import devices``); importing the package
does not import TensorFlow, so ``devices.simulate`` can still configure it.
"""

import os

# Every notebook imports tutorial_lib before TensorFlow, which reads this variable when it
# starts. Level 1 hides TensorFlow's C++ INFO lines (the CPU-instructions banner, the
# profiler's progress reports) and keeps its warnings and errors. A value already set wins:
# the Makefile and the tests use 3. Lines written while TensorFlow loads, before it reads
# the variable ("oneDNN custom operations are on", "Could not find cuda drivers"), cannot be
# silenced this way; tools/clean_notebooks.py drops them from the stored outputs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
