"""Tidy executed notebooks before they are committed (``make notebooks`` runs it).

    python tools/clean_notebooks.py [--root DIR] notebooks/*.ipynb

- Drops TensorFlow's start-up log lines from stderr outputs: they say nothing about the
  lesson, differ per machine, and no environment variable silences all of them (some are
  written before TensorFlow reads TF_CPP_MIN_LOG_LEVEL). An output left empty is removed.
- Shortens absolute paths in tracebacks and stderr: the checkout's root becomes '.', and
  everything up to site-packages becomes '.../site-packages/', so no one's home directory
  is committed.
- Names the kernel the way ipykernel installs it, so JupyterLab does not rewrite the file
  when it is opened.
- Hides every exercise solution: a cell tagged `solution` gets `jupyter.source_hidden`
  (JupyterLab shows it collapsed), loses its stored outputs (they would give the answer
  away) and is tagged `nbval-ignore-output`, so nbval still runs it and its assertions still
  count. Its execution count stays, so the notebook still reads as run top to bottom.

Apart from solutions, only outputs that nbval does not compare (stderr streams, tracebacks) are
edited, so a cleaned notebook validates exactly as before. Cleaning twice changes nothing. A
notebook that cannot be read is named with what is wrong; each file is written to a temporary
file beside it and then moved into place, so an interrupted run leaves no half-written notebook.
"""

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_format import NotebookError, read_notebook  # noqa: E402  (tools/ is not a package)

ROOT = Path(__file__).resolve().parents[1]
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}

# The prefix of a C++ log line: absl's 'I0000 00:00:1796030814.734006    4212 port.cc:153] '
# (TensorFlow >= 2.17) or the older '2024-05-01 12:00:00.123456: I tensorflow/.../port.cc:113] '.
_LOG = r"(?:[IWEF]\d{4} [\d:.]+\s+\d+ |\d{4}-\d\d-\d\d [\d:.]+: [IWEF] )\S+:\d+\] "
_NOISE = [
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    _LOG + r"oneDNN custom operations are on\. .*",
    _LOG + r"Could not find cuda drivers on your machine, GPU will not be used\.",
    _LOG + r"This TensorFlow binary is optimized to use available CPU instructions .*",
    r"To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.",
    _LOG + r"Unable to register (?:cuDNN|cuFFT|cuBLAS) factory: .*",
    _LOG + r"computation placer already registered\. .*",
    _LOG + r"TF-TRT Warning: Could not find TensorRT",
    # Stored outputs come from forced CPU simulation, where the CUDA driver is never used.
    _LOG + r"failed call to cuInit: .*",
    # The profiler's progress reports, once per timeline.trace call.
    _LOG + r"Profiler session (?:initializing|started|collecting data|tear down)\.",
    _LOG + r"Collecting XSpace to repository: .*",
]
NOISE = re.compile("|".join(f"(?:{pattern})" for pattern in _NOISE))

_ANSI = re.compile(r"(\x1b\[[\d;]*m)")  # IPython colours tracebacks; a path sits between codes
_PATH_CHARS = r"[\w.+@~-]"
_START = rf"(?<!{_PATH_CHARS})"  # a whole path, not the tail of a relative one
_SITE = re.compile(rf"{_START}(?:/{_PATH_CHARS}+)+/(site|dist)-packages/")
_STDLIB = re.compile(rf"{_START}(?:/{_PATH_CHARS}+)*/lib/(python\d\.\d+)/")


def drop_noise(text: str) -> str:
    """`text` without the lines that are known start-up noise."""
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not NOISE.fullmatch(line.rstrip("\r\n")))


def shorten_paths(text: str, root: str) -> str:
    """`text` with `root` written as '.' and interpreter prefixes as '.../'."""
    own = re.compile(_START + re.escape(root.rstrip("/")) + "/")
    pieces = _ANSI.split(text)
    for i in range(0, len(pieces), 2):  # even pieces are text, odd ones colour codes
        piece = _SITE.sub(r".../\1-packages/", pieces[i])
        piece = own.sub("./", piece)
        pieces[i] = _STDLIB.sub(r".../\1/", piece)
    return "".join(pieces)


def _edit_text(text, edit):
    """Apply `edit` to a notebook text field, kept a list of lines if it was one."""
    if isinstance(text, str):
        return edit(text)
    return edit("".join(text)).splitlines(keepends=True)


def clean_outputs(outputs: list, root: str) -> list:
    """The outputs of one cell, cleaned; stderr outputs left empty are dropped."""
    cleaned = []
    for output in outputs:
        output = dict(output)
        if output["output_type"] == "stream" and output["name"] == "stderr":
            output["text"] = _edit_text(output["text"], lambda t: shorten_paths(drop_noise(t), root))
            if not "".join(output["text"]):
                continue
        elif output["output_type"] == "error":
            output["traceback"] = [shorten_paths(line, root) for line in output["traceback"]]
        cleaned.append(output)
    return cleaned


def hide_solution(cell: dict) -> dict:
    """A solution cell collapsed in JupyterLab, without stored outputs, still run (not compared) by nbval."""
    metadata = dict(cell.get("metadata", {}))
    metadata["jupyter"] = {**metadata.get("jupyter", {}), "source_hidden": True}
    tags = list(metadata.get("tags", []))
    if cell["cell_type"] == "code" and "nbval-ignore-output" not in tags:
        tags.append("nbval-ignore-output")
    metadata["tags"] = tags
    cell = {**cell, "metadata": metadata}
    if cell["cell_type"] == "code":
        cell["outputs"] = []
    return cell


def clean(notebook: dict, root: str) -> dict:
    """A cleaned copy of `notebook` (the dict of an .ipynb file)."""
    cells = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell = {**cell, "outputs": clean_outputs(cell.get("outputs", []), root)}
        if "solution" in cell.get("metadata", {}).get("tags", []):
            cell = hide_solution(cell)
        cells.append(cell)
    metadata = {**notebook["metadata"], "kernelspec": dict(KERNELSPEC)}
    return {**notebook, "cells": cells, "metadata": metadata}


def dumps(notebook: dict) -> str:
    """The notebook as nbformat writes it, so that an unchanged notebook stays byte-identical."""
    return json.dumps(notebook, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then move it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument(
        "--root", default=str(ROOT), help="the checkout the notebooks ran in, written '.' (default: this one)"
    )
    args = parser.parse_args(argv)
    changed = 0
    for path in args.notebooks:
        try:
            notebook = read_notebook(path)
        except NotebookError as err:
            sys.exit(f"clean_notebooks: {err}")
        after = dumps(clean(notebook, args.root))
        if after != path.read_text():
            write_atomically(path, after)
            changed += 1
    print(f"cleaned {changed} of {len(args.notebooks)} notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
