"""Settings shared by the unit tests and the notebook kernels that nbval starts.

Set here, before any kernel starts, so that every notebook simulates CPU devices and
prints the same outputs on every machine.
"""

import os
import shutil
import tempfile

os.environ["TUTORIAL_DEVICE"] = "cpu"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["PYTHONHASHSEED"] = "0"

# The processes the tests start (notebook kernels, and the servers they start) keep their
# temporary files in a folder of this run. nbval ends each kernel without running its exit
# handlers, which is when TensorFlow's autograph removes the source file it writes for each
# function it converts (nbval on notebook 00 alone left three of them in /tmp). This
# process keeps the system's folder: tempfile has already chosen it (mkdtemp asks for it).
# A pytest-xdist worker inherits the controller's folder through TMPDIR and uses it as it is: a
# folder nested in it would make Chromium's socket path too long (tests/test_site.py).
_CHILDREN_TMP = None if "PYTEST_XDIST_WORKER" in os.environ else tempfile.mkdtemp(prefix="course_tests_children_")
if _CHILDREN_TMP:
    os.environ["TMPDIR"] = _CHILDREN_TMP


def pytest_sessionfinish():
    # nbval ends each notebook's kernel without running its exit handlers: sweep the worker
    # logs that such kernels leave (a later Cluster would, but a test run leaves nothing),
    # and the children's temporary folder with everything they left in it.
    from tutorial_lib import cluster

    cluster.sweep_logs()
    if _CHILDREN_TMP:  # the controller's, once its workers are done
        shutil.rmtree(_CHILDREN_TMP, ignore_errors=True)


def pytest_collection_modifyitems(items):
    # TensorFlow's C++ logs reach a notebook's stderr; they are never compared.
    for item in items:
        parent = item.parent
        if hasattr(parent, "skip_compare") and "stderr" not in parent.skip_compare:
            parent.skip_compare = (*parent.skip_compare, "stderr")
