"""A kernel that used core devices ends quietly: TensorFlow's requests to the stopped workers to
forget its functions ("Failed to remove function remotely ... Connection refused", four lines
each) are not sent at exit (core_devices._no_remote_removals_at_exit).

The child runs at the package's own log level (1: warnings and errors shown), as a student's
kernel does; the tests' level 3 would hide the very lines this test looks for.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
    from tutorial_lib import devices

    names = devices.simulate(2, kind="cores")
    import tensorflow as tf

    @tf.function
    def square(x):
        return tf.matmul(x, x)

    for name in names:  # the function is registered on both workers
        with tf.device(name):
            value = float(tf.reduce_sum(square(tf.ones([4, 4]))))
    print("VALUE", value)
"""
ERROR_LINE = re.compile(r"^E\d{4} .*$|^.*Failed to remove function remotely.*$", re.MULTILINE)


@pytest.mark.slow
def test_a_kernel_with_core_devices_ends_without_error_lines():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    command = [sys.executable, "-c", textwrap.dedent(CHILD)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "VALUE 64.0" in result.stdout
    assert ERROR_LINE.findall(result.stderr) == [], result.stderr[-3000:]
