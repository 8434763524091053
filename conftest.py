"""Settings shared by the unit tests and the notebook kernels that nbval starts.

Set here, before any kernel starts, so that every notebook simulates CPU devices and
prints the same outputs on every machine.
"""

import os

os.environ["TUTORIAL_DEVICE"] = "cpu"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["PYTHONHASHSEED"] = "0"


def pytest_sessionfinish():
    # nbval ends each notebook's kernel without running its exit handlers: sweep the worker
    # logs that such kernels leave (a later Cluster would, but a test run leaves nothing).
    from tutorial_lib import cluster

    cluster.sweep_logs()


def pytest_collection_modifyitems(items):
    # TensorFlow's C++ logs reach a notebook's stderr; they are never compared.
    for item in items:
        parent = item.parent
        if hasattr(parent, "skip_compare") and "stderr" not in parent.skip_compare:
            parent.skip_compare = (*parent.skip_compare, "stderr")
