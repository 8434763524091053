"""Print the TF_ENABLE_ONEDNN_OPTS value that switches TensorFlow's oneDNN the other way from this run's.

`make test` runs the notebooks once more with it: oneDNN and Eigen round float32 differently, and
a stored figure printed finer than its check guarantees differs on a machine of the other kind
(an Intel Xeon with AVX-512 printed 2.1e-04 where an AMD EPYC stored 2.0e-04).

What TensorFlow 2.21 does (tensorflow/core/util/port.cc, IsMklEnabled): on Linux, oneDNN is on by
default when the CPU has AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX, off otherwise, and
TF_ENABLE_ONEDNN_OPTS=0 or 1, read once when TensorFlow starts, overrides the default. Rather than
repeat that rule, this asks TensorFlow, through the PRIVATE `_pywrap_util_port.IsMklEnabled` (no
public API says; the public sign is the "oneDNN custom operations are on" log line), in this
environment and then in a child with the flipped value, and prints nothing (saying why on stderr)
when the flip does not take (a TensorFlow built without oneDNN, as on macOS)."""

import os
import subprocess
import sys

ASK = "from tensorflow.python.util import _pywrap_util_port as port; print(int(port.IsMklEnabled()))"


def onednn_on(env) -> bool:
    # A child per setting: TensorFlow reads the variable once per process.
    answer = subprocess.run([sys.executable, "-c", ASK], env=env, capture_output=True, text=True, timeout=300)
    if answer.returncode:
        sys.exit(f"onednn_flip: TensorFlow did not start:\n{answer.stderr[-2000:]}")
    return answer.stdout.strip().splitlines()[-1] == "1"


def main() -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    now = onednn_on(env)
    flip = "0" if now else "1"
    if onednn_on({**env, "TF_ENABLE_ONEDNN_OPTS": flip}) == now:
        # Nothing on stdout: `make test` then skips the second pass.
        print(
            f"onednn_flip: oneDNN stays {'on' if now else 'off'} with TF_ENABLE_ONEDNN_OPTS={flip}: this TensorFlow "
            "cannot switch it, so there is no other math library to run the notebooks under",
            file=sys.stderr,
        )
        return
    print(flip)


if __name__ == "__main__":
    main()
