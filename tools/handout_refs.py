"""What the students' hand-out and the course's site refer to that they do not hold.

    python tools/handout_refs.py      (builds both in a temporary folder; exit 1 with the list)

Walked: the hand-out's README, Makefile, environment.yml and notebooks (their sources: the
outputs are cleared), and the text of every page of the site (outputs included). Flagged:

- a path (`tutorial_lib/...`, `examples/...`, `notebooks/...`, `tests/...`, `tools/...`,
  `teacher/...`) that the hand-out lacks: the site's readers run the hand-out, too;
- `make x` where the hand-out's Makefile has no target x, or cannot plan it with its own files;
- the README without a section the README they ship has ("the README's *Shared servers*");
- a solution shown or promised ("solution" in a sentence that does not say it is the student's
  own, empty or removed), where solutions are removed;
- "stored outputs" in the hand-out, whose outputs are cleared.
"""

import json
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_format import PATH_REF  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAKE_REF = re.compile(r"`make ([\w-]+)|^\s*(?:\$ )?make ([\w-]+)", re.MULTILINE)
SOLUTION = re.compile(r"\bsolutions?\b", re.IGNORECASE)
# A sentence that says a solution is absent, or the student's own, promises none.
NO_PROMISE = re.compile(r"your solution|without|empty|removed|placeholder", re.IGNORECASE)
README_REF = re.compile(r"\b(?:the|this) README\b(?!\.md)|\bREADME's")
STORED_OUTPUTS = re.compile(r"\bstored outputs?\b", re.IGNORECASE)
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)


class _Text(HTMLParser):
    """A page's visible text, and apart from it the text of its inline code (where `make x` is written)."""

    def __init__(self, page: str):
        super().__init__()
        self.text, self.code, self._in = [], [], {"code": 0, "style": 0, "script": 0}
        self.feed(page)

    def handle_starttag(self, tag, _attrs):
        if tag in self._in:
            self._in[tag] += 1

    def handle_endtag(self, tag):
        if self._in.get(tag):
            self._in[tag] -= 1

    def handle_data(self, data):
        if self._in["style"] or self._in["script"]:  # the page's machinery, not its text
            return
        self.text.append(data)
        if self._in["code"]:
            self.code.append(data)


def handout_texts(folder: Path) -> dict[str, str]:
    texts = {name: (folder / name).read_text() for name in ("README.md", "Makefile", "environment.yml")}
    for path in sorted((folder / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[f"notebooks/{path.name}"] = "\n\n".join("".join(c["source"]) for c in cells)
    return texts


def site_pages(folder: Path) -> dict[str, tuple[str, str]]:
    """Each page's (text, inline code as lines)."""
    pages = {}
    for path in sorted(folder.glob("*.html")):
        parsed = _Text(path.read_text())
        pages[path.name] = ("".join(parsed.text), "\n".join(parsed.code))
    return pages


def readme_sections(readme: str) -> list[str]:
    return [re.sub(r"[*`_]", "", h).strip() for h in HEADING.findall(readme)]


def _readme_refs(text: str, sections: list[str]) -> list[str]:
    """Each mention of the README that names none of its sections."""
    bad = []
    for match in README_REF.finditer(text):
        after = re.sub(r"^(?:'s)?\s*\**", "", text[match.end() : match.end() + 80])
        if not any(after.startswith(s) for s in sections):
            bad.append(f"names no section of the README it ships: {_sentence(text, match)!r}")
    return bad


def _make_targets(handout: Path, targets: set[str]) -> dict[str, str]:
    """Why each target cannot run in the hand-out ('' when it can)."""
    why = {}
    for target in sorted(targets):
        plan = subprocess.run(["make", "-n", "-B", target], cwd=handout, capture_output=True, text=True)
        lacking = [p for p in PATH_REF.findall(plan.stdout) if not (handout / p).exists()]
        why[target] = plan.stderr.strip()[-200:] if plan.returncode else (f"needs {lacking}" if lacking else "")
    return why


def unheld(texts: dict[str, str], handout: Path, readme: str, *, outputs_kept: bool, code=None) -> list[str]:
    """The references of `texts` {name: text} that the hand-out (or the site) does not hold. `code`
    {name: text} is where `make x` is looked for (the text itself by default)."""
    code = code or texts
    sections = readme_sections(readme)
    found = []
    for name, text in texts.items():
        lacking = [p for p in PATH_REF.findall(text) if not (handout / p).exists()]
        found += [f"{name}: names {p}, which the hand-out lacks" for p in lacking]
        found += [f"{name}: {r}" for r in _readme_refs(text, sections)]
        found += [f"{name}: promises a solution: {_sentence(text, m)!r}" for m in _promises(text)]
        if not outputs_kept:
            stored = STORED_OUTPUTS.finditer(text)
            found += [f"{name}: speaks of stored outputs: {_sentence(text, m)!r}" for m in stored]
    wanted = {(name, a or b) for name, text in code.items() for a, b in MAKE_REF.findall(text)}
    why = _make_targets(handout, {t for _, t in wanted})
    found += [f"{name}: make {t}: {why[t] or 'ok'}" for name, t in sorted(wanted) if why[t]]
    return found


def _sentence(text: str, match: re.Match) -> str:
    start = max(text.rfind(". ", 0, match.start()), text.rfind("\n\n", 0, match.start())) + 1
    ends = [i for i in (text.find(". ", match.end()), text.find("\n\n", match.end())) if i >= 0]
    return " ".join(text[start : min(ends, default=len(text))].split())


def _promises(text: str) -> list[re.Match]:
    return [m for m in SOLUTION.finditer(text) if not NO_PROMISE.search(_sentence(text, m))]


def check(handout: Path, site: Path) -> list[str]:
    """Everything the hand-out at `handout` and the site at `site` refer to and do not hold."""
    readme = (handout / "README.md").read_text()
    found = unheld(handout_texts(handout), handout, readme, outputs_kept=False)
    pages = site_pages(site)
    texts = {f"site/{n}": t for n, (t, _) in pages.items()}
    code = {f"site/{n}": c for n, (_, c) in pages.items()}
    return found + unheld(texts, handout, readme, outputs_kept=True, code=code)


def main() -> int:
    import build_site
    import student_copies

    with tempfile.TemporaryDirectory() as tmp:
        handout, site = Path(tmp) / "student", Path(tmp) / "site"
        student_copies.write_handout(ROOT / "notebooks", handout, Path(tmp) / "student.zip")
        build_site.build(ROOT / "notebooks", site)
        found = check(handout, site)
    print("\n".join(found + [f"{len(found)} reference(s) to what the hand-out or the site lacks"]))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
