"""The course's benchmark: `python -m tutorial_lib.bench` measures every case on this machine.

Each case times its variants in interleaved rounds on the same devices (`timing.interleaved`)
and reports ratios with the range their spreads allow and a verdict: only ratios carry over
from one machine, or one minute, to the next. The devices are core devices by default.

- `rows`: what a row holds, the one way back to a `Timing`, the table, the JSON file;
- `scaling`: weak and strong scaling;
- `cases`: gradient packing, all-reduce methods with the alpha-beta fit, input, mixed precision;
- `pipeline`: the pipeline against the naive split;
- `__main__`: the command line.

Import the modules by name: ``from tutorial_lib.bench import scaling``.
"""
