"""Lessons: code that a notebook defines in a cell, the same in the take-away files and the package.

    python tools/lessons.py            list the definitions that differ from their notebook's (exit 1 if any)
    python tools/lessons.py --write    make them equal again (or: make lessons)

A marked definition is the top-level function, class or assignment that follows a line
`# lesson: NN_name` in a .py file of examples/ or tutorial_lib/, where notebooks/NN_name.ipynb
defines the same name in one of its code cells. Both must be the same to the letter of their
syntax tree, docstring included (comments and formatting may differ), so that an edit of one
alone fails `make unit` in seconds instead of drifting until a full run (tests/test_lessons.py).

Which side is the source: the take-away files (examples/) hold the one copy of each method
that a reader copies and the programs train, so `--write` rewrites the notebook's cell from
them; for a lesson that only the package keeps (the hand-built ring, the float64 step), the
notebook is the source and `--write` rewrites the package's copy.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tutorial_lib", "examples")
MARKER = re.compile(r"^# lesson: (?P<notebook>\d\d_\w+)\b")
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


class LessonError(ValueError):
    """A marker that names no notebook, or a name the notebook does not define exactly once."""


@dataclass(frozen=True)
class Definition:
    name: str
    source: str  # the definition's text, decorators included
    tree: str  # ast.dump of the definition: what must be equal


@dataclass(frozen=True)
class Copy:
    path: Path
    notebook: str  # the notebook's stem, e.g. "03_nccl_allreduce"
    first: int  # first line of the definition in the file (1-based), decorators included
    last: int  # its last line
    definition: Definition


def _name(node) -> str | None:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    if len(targets) == 1 and isinstance(targets[0], ast.Name):
        return targets[0].id
    return None


def _first_line(node) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def _definitions(source: str) -> list[tuple[ast.AST, Definition]]:
    """Every top-level named definition of `source`, with its text and tree."""
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.parse(source).body:
        name = _name(node) if isinstance(node, _DEFINITIONS) else None
        if name:
            text = "".join(lines[_first_line(node) - 1 : node.end_lineno])
            found.append((node, Definition(name, text, ast.dump(node))))
    return found


def _cell_source(cell: dict) -> str:
    """A code cell's Python: IPython's magics and shell lines (`%...`, `!...`) left out."""
    text = "".join(cell["source"])
    return "".join(line for line in text.splitlines(keepends=True) if not line.lstrip().startswith(("%", "!")))


def notebook_definitions(path: Path) -> dict[str, list[Definition]]:
    """name -> every top-level definition of that name in the notebook's code cells, in order."""
    cells = json.loads(path.read_text())["cells"]
    found: dict[str, list[Definition]] = {}
    for number, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        try:
            definitions = _definitions(_cell_source(cell))
        except SyntaxError as err:
            raise LessonError(f"{path.name}, cell {number}: not Python ({err.msg}, line {err.lineno})") from None
        for _, definition in definitions:
            found.setdefault(definition.name, []).append(definition)
    return found


def copies(root: Path = ROOT) -> list[Copy]:
    """Every marked copy in the package and the examples."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            found += _copies_in(path)
    return found


def _copies_in(path: Path) -> list[Copy]:
    source = path.read_text()
    lines = source.splitlines()
    by_first_line = {_first_line(node): (node, d) for node, d in _definitions(source)}
    found = []
    for number, line in enumerate(lines, start=1):
        marker = MARKER.match(line)
        if not marker:
            continue
        if number + 1 not in by_first_line:
            raise LessonError(
                f"{path.relative_to(path.parents[1])}:{number}: '# lesson:' must stand on the line just above a "
                "top-level def, class or assignment"
            )
        node, definition = by_first_line[number + 1]
        found.append(Copy(path, marker["notebook"], number + 1, node.end_lineno, definition))
    return found


def original(copy: Copy, root: Path = ROOT) -> Definition:
    """The notebook's definition that `copy` copies."""
    path = root / "notebooks" / f"{copy.notebook}.ipynb"
    where = f"{copy.path.name}:{copy.first}"
    if not path.exists():
        raise LessonError(f"{where}: the marker names notebooks/{path.name}, which does not exist")
    defined = notebook_definitions(path).get(copy.definition.name, [])
    if len(defined) != 1:
        raise LessonError(
            f"{where}: {path.name} should define {copy.definition.name!r} in exactly one code cell, "
            f"it does in {len(defined)}"
        )
    return defined[0]


def drifted(root: Path = ROOT) -> list[tuple[Copy, Definition]]:
    """The copies that differ from their notebook's definition, each with that definition."""
    return [(c, o) for c in copies(root) if (o := original(c, root)).tree != c.definition.tree]


def write(pairs, root: Path = ROOT) -> None:
    """Make each pair equal: a take-away file's definition into its notebook's cell, a notebook's definition into
    the package's copy (the last copies in a file first)."""
    for copy, definition in sorted(pairs, key=lambda p: (str(p[0].path), -p[0].first)):
        if copy.path.parent.name == "examples":
            _write_cell(root / "notebooks" / f"{copy.notebook}.ipynb", copy.definition)
            continue
        lines = copy.path.read_text().splitlines(keepends=True)
        text = definition.source if definition.source.endswith("\n") else definition.source + "\n"
        lines[copy.first - 1 : copy.last] = [text]
        copy.path.write_text("".join(lines))


def _write_cell(path: Path, definition: Definition) -> None:
    """Replace the notebook's own definition of `definition.name` by `definition`'s text, in its code cell."""
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = _cell_source(cell)
        found = [node for node, d in _definitions(source) if d.name == definition.name]
        if found:
            text = "".join(cell["source"])
            lines = text.splitlines(keepends=True)
            offset = _magic_lines_before(text, _first_line(found[0]))
            first, last = _first_line(found[0]) + offset, found[0].end_lineno + offset
            new = definition.source if definition.source.endswith("\n") else definition.source + "\n"
            if last == len(lines) and not text.endswith("\n"):
                new = new.rstrip("\n")
            lines[first - 1 : last] = [new]
            cell["source"] = "".join(lines).splitlines(keepends=True)
            path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
            return


def _magic_lines_before(text: str, line: int) -> int:
    """How many magic or shell lines (left out by _cell_source) come before the `line`-th line that is kept."""
    skipped = kept = 0
    for raw in text.splitlines():
        if raw.lstrip().startswith(("%", "!")):
            skipped += 1
            continue
        kept += 1
        if kept == line:
            break
    return skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check (or rewrite) the copies of the notebooks' lesson code.")
    parser.add_argument("--write", action="store_true", help="rewrite the copies that differ from their notebook")
    args = parser.parse_args(argv)
    try:
        pairs = drifted()
    except LessonError as err:
        print(f"lessons: {err}", file=sys.stderr)
        return 2
    for copy, _ in pairs:
        print(f"{copy.path.relative_to(ROOT)}:{copy.first}: {copy.definition.name} differs from {copy.notebook}.ipynb")
    if args.write and pairs:
        write(pairs)
        print(f"rewrote {len(pairs)} definitions: notebook cells from examples/, the package's copies from notebooks")
        return 0
    print(f"{len(copies())} copies checked, {len(pairs)} differ" + ("; make lessons rewrites them" if pairs else ""))
    return 1 if pairs else 0


if __name__ == "__main__":
    sys.exit(main())
