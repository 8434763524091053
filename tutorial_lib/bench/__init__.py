"""The course's benchmark: `python -m tutorial_lib.bench` measures every case on this machine.

Each case times its variants in interleaved rounds (`timing.interleaved`) and reports ratios
with their range and a verdict. Modules: `rows` (rows, tables, JSON), `scaling`, `cases`,
`pipeline`, and `__main__` (the command line).
"""
