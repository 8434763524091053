"""Plumbing for the multi-device TensorFlow course; each module is one idea.

Import modules by name (``from tutorial_lib import devices``); importing the package
does not import TensorFlow, so ``devices.simulate`` can still configure it.

Importing the package also keeps TensorFlow's start-up noise out of the first cell, in any
kernel (``make lab``, a JupyterHub kernel, a plain ``jupyter lab``, a script): the lines it
writes while it loads ("All log messages before absl::InitializeLog()", "oneDNN custom
operations are on", "Could not find cuda drivers") and, on a machine without a GPU, the
"failed call to cuInit" error. They are written by C++ straight to file descriptor 2, before
TensorFlow reads any setting, so the package filters that descriptor: a thread forwards
every other line unchanged, until `stop_filtering_stderr()` (devices.simulate may call it once
TensorFlow has started) or the exit. Set TUTORIAL_RAW_STDERR=1 to see everything.
"""

import atexit
import os
import re
import sys
import threading

# Level 1 hides TensorFlow's C++ INFO lines (the CPU-instructions banner, the profiler's
# progress reports) and keeps its warnings and errors. A value already set wins: the
# Makefile and the tests use 3.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

_LOG = rb"(?:[IWEF]\d{4} [\d:.]+\s+\d+ |\d{4}-\d\d-\d\d [\d:.]+: [IWEF] )\S+:\d+\] "
NOISE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|" + _LOG + rb"(?:oneDNN custom operations are on\."
    rb"|Could not find cuda drivers on your machine"
    rb"|failed call to cuInit: "
    rb"|This TensorFlow binary is optimized to use available CPU instructions"
    rb"|Unable to register (?:cuDNN|cuFFT|cuBLAS) factory"
    rb"|computation placer already registered"
    rb"|TF-TRT Warning: Could not find TensorRT)"
    rb"|To enable the following instructions: .* rebuild TensorFlow"
)
# The start of a line that may turn out to be noise: held back until its end arrives.
_MAYBE_NOISE = re.compile(rb"^(?:W(?:A(?:R(?:N(?:I(?:N(?:G(?::.*)?)?)?)?)?)?)?|[IWEF]\d{0,4}(?: .*)?|T(?:o.*)?|\d.*)$")


def _forward(read_fd: int, out_fd: int) -> None:
    """Copy `read_fd` to `out_fd` without the noise lines, until the pipe closes."""
    pending = b""
    while chunk := os.read(read_fd, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        out = b"".join(line + b"\n" for line in lines if not NOISE.match(line))
        if pending and not _MAYBE_NOISE.match(pending):  # a prompt or a progress bar: show it now
            out, pending = out + pending, b""
        if out:
            os.write(out_fd, out)
    if pending and not NOISE.match(pending):
        os.write(out_fd, pending)


_FILTER = {}  # the saved descriptor 2 and the forwarding thread, while the filter is on


def _filter_stderr() -> None:
    """Put a filtering pipe on file descriptor 2, until stop_filtering_stderr() or the exit."""
    if os.environ.get("TUTORIAL_RAW_STDERR") or _FILTER:
        return
    try:
        saved = os.dup(2)
        read_fd, write_fd = os.pipe()
    except OSError:  # no descriptor 2 (a service without stderr): nothing to filter
        return
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    thread = threading.Thread(target=_forward, args=(read_fd, saved), name="tutorial_lib stderr filter", daemon=True)
    thread.start()
    _FILTER.update(saved=saved, thread=thread)
    atexit.register(stop_filtering_stderr)  # at exit the last lines (a traceback) must still come out


def stop_filtering_stderr() -> None:
    """Give descriptor 2 back once TensorFlow has started (devices.simulate may call it), so that a
    later crash's last words cannot be lost in the pipe. Safe to call more than once."""
    if not _FILTER:
        return
    sys.stderr.flush()
    os.dup2(_FILTER["saved"], 2)  # closes this process's write end; the thread sees the end of the pipe
    _FILTER["thread"].join(timeout=1)  # a child process that still holds the pipe must not delay us
    os.close(_FILTER.pop("saved"))
    _FILTER.clear()


_filter_stderr()

# The take-away folder's method files (examples/data_parallel.py, examples/pipeline_parallel.py...) are the one
# copy of the methods that the notebooks teach: the package imports them by their own names, as the take-away's
# programs do, with the folder at the END of the import path, so that it can shadow nothing installed.
TAKE_AWAY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if TAKE_AWAY not in sys.path:
    sys.path.append(TAKE_AWAY)
