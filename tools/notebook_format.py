"""Check that the course notebooks follow the course's format (no kernel; it reads the files).

    python tools/notebook_format.py [notebooks/*.ipynb]

The format: cell 0 has `# NN · Title`, "The question this notebook answers", the learning
objectives, the prerequisites and an exact Time line (core path and deep dives), and, in the
notebooks whose answer is a file to copy, "Take it away" naming it; cell 1 is `## Setup` and
cell 2 calls `devices.simulate` first; then sections `## k. <question>?` (deep dives marked),
`## Exercises` with `### Exercise k · title` each followed by exactly one solution cell,
`## Summary` with a Next link, and `## Questionnaire`. Prose says no "seed" (only random seeds
in code have one) and names no file, notebook, module or function that does not exist.

It also holds the one check of exercise solutions that the hand-out (tools/student_copies.py)
and the site (tools/build_site.py) both run, so that neither can ship an answer.
"""

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAKE_AWAY = {"02", "03", "04", "05", "08"}  # notebooks whose answer is a file in examples/
TIME = re.compile(
    r"^\*\*Time\.\*\* About (\d+) minutes on the core path \(sections 1-(\d+)\)"
    r"(?:, plus about (\d+) minutes of deep dives \(sections? (\d+)(?:-(\d+))?\)|; no deep dives)\.$",
    re.MULTILINE,
)
EXERCISE = re.compile(r"^### Exercise (\d+) · \S.*$")
SECTION = re.compile(r"^## (\d+)\. (.+)$")
SEED = re.compile(r"\bseeds?\b", re.IGNORECASE)
# Where prose names something in the checkout: a path with a known top folder, a notebook file,
# or a dotted name inside the package.
PATH_REF = re.compile(r"(?<![\w./-])((?:tests|tools|examples|tutorial_lib|notebooks|teacher)/[\w./-]*\w)")
NOTEBOOK_REF = re.compile(r"(?<![\w/-])(\d\d_\w+\.ipynb)")
FILE_SUFFIXES = {"py", "json", "md", "ipynb", "csv", "txt", "cfg", "toml", "yml"}
DOTTED_REF = re.compile(r"\b(tutorial_lib(?:\.\w+)+)")


class NotebookError(ValueError):
    """A notebook that cannot be read or used as it is, naming the file and the cell."""


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return text if isinstance(text, str) else "".join(text)


def tags(cell: dict) -> list:
    found = (cell.get("metadata") or {}).get("tags") or []  # metadata or tags null: none
    return found if isinstance(found, list) else []


def read_notebook(path: Path) -> dict:
    """The notebook at `path`; a NotebookError naming the file and, where it is one, the cell."""
    try:
        notebook = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise NotebookError(f"{path}: not a readable notebook ({err}); restore it with git") from None
    if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
        raise NotebookError(f"{path}: has no list of cells; is it a notebook?")
    for i, part in enumerate([notebook, *notebook["cells"]]):
        where = f"cell {i - 1}" if i else "the notebook"
        if i and (not isinstance(part, dict) or "cell_type" not in part or "source" not in part):
            raise NotebookError(f"{path}: {where} has no cell_type or no source; fix or delete it in JupyterLab")
        if part.get("metadata") is None:  # null, as a hand edit or a tool may leave it: no metadata, as {}
            part["metadata"] = {}
        if not isinstance(part["metadata"], dict):
            raise NotebookError(f"{path}: {where} has metadata {part['metadata']!r}, not an object; make it {{}}")
    return notebook


# --- Exercise solutions: the check the hand-out and the site share -------------------------------


def exercise_problems(notebook: dict, name: str) -> list[str]:
    """What is wrong with the notebook's exercises: every `### Exercise k · title` (k = 1, 2, ...)
    must be followed directly by exactly one cell tagged `solution`, and no other cell may be one."""
    cells, problems, expected = notebook["cells"], [], 1
    answered = set()
    for i, cell in enumerate(cells):
        match = EXERCISE.match(source(cell).strip().split("\n")[0]) if cell["cell_type"] == "markdown" else None
        if not match:
            continue
        if int(match.group(1)) != expected:
            problems.append(f"{name}: cell {i} is exercise {match.group(1)}, expected exercise {expected}")
        expected += 1
        after = cells[i + 1] if i + 1 < len(cells) else None
        if after is None or "solution" not in tags(after):
            problems.append(f"{name}: cell {i} ({match.group(0)}) is not followed by a cell tagged 'solution'")
        else:
            answered.add(i + 1)
            if i + 2 < len(cells) and "solution" in tags(cells[i + 2]):
                problems.append(f"{name}: cells {i + 1} and {i + 2} are both solutions of {match.group(0)}; keep one")
                answered.add(i + 2)
    for i, cell in enumerate(cells):
        if "solution" in tags(cell) and i not in answered:
            problems.append(f"{name}: cell {i} is tagged 'solution' but is not right after an '### Exercise k · title'")
    return problems


def check_exercises(notebook: dict, name: str) -> None:
    """Raise a NotebookError listing every exercise problem of the notebook."""
    problems = exercise_problems(notebook, name)
    if problems:
        raise NotebookError("; ".join(problems) + " (each exercise needs exactly one solution cell under it)")


def _answer_lines(cell: dict) -> set[str]:
    """The lines of a solution's source and outputs that would give it away (not blank, not short)."""
    texts = [source(cell)]
    for output in cell.get("outputs", []):
        text = output.get("text", "")
        texts.append(text if isinstance(text, str) else "".join(text))
        for value in output.get("data", {}).values():
            texts.append(value if isinstance(value, str) else "".join(value))
    return {line.strip() for text in texts for line in text.splitlines() if len(line.strip()) >= 12}


def leaks(original: dict, public: dict, name: str) -> list[str]:
    """Where the students' copy `public` of `original` still shows a solution: a solution cell that
    keeps outputs, or a line of a solution's source or outputs that no other cell has."""
    answers, elsewhere = set(), set()
    for cell in original["cells"]:
        if "solution" in tags(cell):
            answers |= _answer_lines(cell)
        else:
            elsewhere |= _answer_lines(cell)
    answers -= elsewhere  # a line the lesson shows too ('except ValueError as err:') is no answer
    found = []
    for i, cell in enumerate(public["cells"]):
        shown = _answer_lines(cell)
        if "solution" in tags(cell) and cell.get("outputs"):
            found.append(f"{name}: cell {i} is a solution and keeps its outputs")
        for line in sorted(shown & answers)[:1]:
            found.append(f"{name}: cell {i} shows a solution's line {line!r}")
    return found


def check_no_leaks(original: dict, public: dict, name: str) -> None:
    problems = leaks(original, public, name)
    if problems:
        raise NotebookError("; ".join(problems) + "; the students' copy must not show any solution")


# --- The format ----------------------------------------------------------------------------------


def _prose(text: str) -> str:
    """Markdown without code spans and code blocks: what a reader reads as words."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.sub(r"`[^`]*`", "", text)


def seed_problems(text: str, where: str) -> list[str]:
    """'seed' in prose, except a random seed."""
    prose = re.sub(r"\brandom seeds?\b", "", _prose(text), flags=re.IGNORECASE)
    return [
        f"{where}: says {m.group(0)!r}; name the question itself (keep the word for random seeds)"
        for m in SEED.finditer(prose)
    ][:1]


def _module_names(module: str) -> set[str] | None:
    """The top-level names of tutorial_lib's `module` ('bench.cases'), or None if there is no such module."""
    base = ROOT / "tutorial_lib" / Path(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.exists():
        return None
    names = {p.stem for p in base.iterdir()} if base.is_dir() else set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def dotted_exists(dotted: str) -> bool:
    """Whether `tutorial_lib.a.b...` names a module, or a top-level name of one."""
    parts = dotted.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        names = _module_names(".".join(parts[:cut]))
        if names is not None:
            return cut == len(parts) or parts[cut] in names
    return False


def _imported_modules(notebook: dict) -> set[str]:
    """The tutorial_lib modules the notebook imports by their own name (`from tutorial_lib import x`)."""
    found = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            for m in re.finditer(r"from tutorial_lib(\.\w+)? import ([\w, ()]+)", source(cell)):
                prefix = m.group(1) or ""
                found |= {
                    (prefix + "." + n.strip()).lstrip(".") for n in m.group(2).strip("()").split(",") if n.strip()
                }
    return {m for m in found if _module_names(m) is not None and "." not in m}


def reference_problems(text: str, where: str, modules: set[str] = frozenset()) -> list[str]:
    """Names in `text` of files, notebooks, modules or functions that do not exist in the checkout."""
    problems = [f"{where}: names {p}, which does not exist" for p in PATH_REF.findall(text) if not (ROOT / p).exists()]
    problems += [
        f"{where}: links {n}, which does not exist"
        for n in NOTEBOOK_REF.findall(text)
        if not (ROOT / "notebooks" / n).exists()
    ]
    problems += [f"{where}: names {d}, which does not exist" for d in DOTTED_REF.findall(text) if not dotted_exists(d)]
    for module in modules:
        for attr in re.findall(rf"(?<![\w.]){module}\.([A-Za-z_]\w*)", text):
            if attr in FILE_SUFFIXES:  # 'published.py' names a file, checked as a path
                continue
            if not dotted_exists(f"tutorial_lib.{module}.{attr}"):
                problems.append(f"{where}: names {module}.{attr}, which tutorial_lib.{module} does not define")
    return list(dict.fromkeys(problems))


# Calls a setup cell may make before simulate: they only count the devices, starting nothing.
_BEFORE_SIMULATE = {"len", "tf.config.list_physical_devices"}


def _first_call(code: str) -> str:
    """The dotted name of the first call the code makes, in source order, leaving out those that
    only count devices ('' if none)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ""
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    names = [ast.unparse(n.func) for n in calls if ast.unparse(n.func) not in _BEFORE_SIMULATE]
    return names[0] if names else ""


def header_problems(notebook: dict, name: str) -> list[str]:
    cells, problems = notebook["cells"], []
    number = name[:2]
    head = source(cells[0]) if cells and cells[0]["cell_type"] == "markdown" else ""
    if not re.match(rf"# {number} · \S", head):
        problems.append(f"{name}: cell 0 must be markdown starting '# {number} · Title'")
    for part in ("**The question this notebook answers.**", "**Learning objectives.**", "**Prerequisites.**"):
        if not re.search(rf"^{re.escape(part)}", head, re.MULTILINE):
            problems.append(f"{name}: cell 0 has no paragraph starting {part}")
    if not re.search(r"^\*\*Learning objectives\.\*\*.*\n(?:.*\n)*?\s*(?:[-*]|\d+\.) ", head, re.MULTILINE):
        problems.append(f"{name}: cell 0's learning objectives are not a list")
    if not TIME.search(head):
        problems.append(
            f"{name}: cell 0 has no line '**Time.** About N minutes on the core path (sections 1-K), "
            "plus about M minutes of deep dives (sections K+1-L).' (or '...(sections 1-K); no deep dives.')"
        )
    take_away = r"^\*\*Take it away\.\*\*.*`?(?:examples|tutorial_lib)/\w+\.py"  # 08's answer is a module
    if number in TAKE_AWAY and not re.search(take_away, head, re.MULTILINE):
        problems.append(f"{name}: cell 0 has no '**Take it away.**' naming the file that holds the answer")
    if len(cells) < 3 or source(cells[1]).split("\n")[0].strip() != "## Setup" or cells[2]["cell_type"] != "code":
        problems.append(f"{name}: cell 1 must be '## Setup' and cell 2 the setup code")
    elif _first_call(source(cells[2])) != "devices.simulate":
        problems.append(f"{name}: the setup cell's first call must be devices.simulate(...)")
    return problems


def _sections(notebook: dict) -> tuple[list, list]:
    """The numbered sections [(cell, number, title)] and the other '## ' headings after Setup."""
    numbered, closing = [], []
    for i, cell in enumerate(notebook["cells"][1:], start=1):
        headings = re.findall(r"^## .+$", source(cell), re.MULTILINE) if cell["cell_type"] == "markdown" else []
        for heading in headings:
            match = SECTION.match(heading)
            if match:
                numbered.append((i, int(match.group(1)), match.group(2)))
            elif heading != "## Setup":
                closing.append(heading)
    return numbered, closing


def _deep_dive_problems(notebook: dict, name: str, numbered: list) -> list[str]:
    """Deep dives marked in their headings exactly where the Time line puts them."""
    time = TIME.search(source(notebook["cells"][0]))
    if not time:
        return []
    core = int(time.group(2))
    first = int(time.group(4)) if time.group(4) else core + 1
    last = int(time.group(5) or time.group(4) or core)
    problems = []
    if first != core + 1 or last != len(numbered):
        problems.append(
            f"{name}: the Time line's sections (1-{core}, {first}-{last}) do not cover sections 1-{len(numbered)}"
        )
    for i, number, title in numbered:
        if title.endswith(" (deep dive)") != (number > core):
            kind = "a deep dive" if number > core else "core"
            problems.append(
                f"{name}: cell {i}: section {number} is {kind} by the Time line; "
                "end deep-dive headings, and only those, with ' (deep dive)'"
            )
    return problems


def section_problems(notebook: dict, name: str) -> list[str]:
    """Sections numbered 1..L, questions, deep dives where the Time line says, then the closing parts."""
    numbered, closing = _sections(notebook)
    problems = []
    for k, (i, number, title) in enumerate(numbered, start=1):
        if number != k:
            problems.append(f"{name}: cell {i} is section {number}, expected section {k}")
        if not title.removesuffix(" (deep dive)").endswith("?"):
            problems.append(f"{name}: cell {i}: section {number}'s heading is not a question: {title!r}")
    if closing != ["## Exercises", "## Summary", "## Questionnaire"]:
        problems.append(
            f"{name}: after the sections expected '## Exercises', '## Summary', '## Questionnaire', found {closing}"
        )
    return problems + _deep_dive_problems(notebook, name, numbered)


def closing_problems(notebook: dict, name: str) -> list[str]:
    problems = []
    texts = [source(c) for c in notebook["cells"] if c["cell_type"] == "markdown"]
    summary = next((t for t in texts if t.startswith("## Summary")), "")
    if not re.search(r"\*\*Next:\*\* \[[^\]]+\]\(\d\d_\w+\.ipynb\)", summary) and "**Next:**" not in summary:
        problems.append(f"{name}: the Summary has no '**Next:** [NN · Title](NN_x.ipynb)' line")
    questions = next((t for t in texts if t.startswith("## Questionnaire")), "")
    if not re.search(r"^1\. ", questions, re.MULTILINE):
        problems.append(f"{name}: the Questionnaire has no numbered questions")
    for i, cell in enumerate(notebook["cells"]):
        if "solution" not in tags(cell):
            continue
        if cell["cell_type"] != "code" or "assert" not in source(cell):
            problems.append(f"{name}: solution cell {i} must be a code cell that asserts something")
        if not cell.get("metadata", {}).get("jupyter", {}).get("source_hidden") or cell.get("outputs"):
            problems.append(
                f"{name}: solution cell {i} shows its code or its outputs; run tools/clean_notebooks.py on it"
            )
    return problems


def notebook_problems(path: Path) -> list[str]:
    """Every format problem of the notebook at `path`, each naming the notebook and the cell."""
    name = Path(path).name
    try:
        notebook = read_notebook(path)
    except NotebookError as err:
        return [str(err)]
    problems = header_problems(notebook, name) + section_problems(notebook, name)
    problems += exercise_problems(notebook, name) + closing_problems(notebook, name)
    modules = _imported_modules(notebook)
    for i, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "markdown":
            problems += seed_problems(source(cell), f"{name}: cell {i}")
            problems += reference_problems(source(cell), f"{name}: cell {i}", modules)
        else:
            problems += reference_problems(source(cell), f"{name}: cell {i}", set())
    return problems


def text_file_problems(path: Path) -> list[str]:
    """The README's and the teacher files' problems: 'seed' in prose, dangling references."""
    text = Path(path).read_text()
    where = str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else str(path)
    return seed_problems(text, where) + reference_problems(text, where)


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    problems = []
    for path in paths:
        problems += notebook_problems(path) if path.suffix == ".ipynb" else text_file_problems(path)
    for problem in problems:
        print(problem)
    print(f"notebook_format: {len(problems)} problem(s) in {len(paths)} file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
