"""Build the course as a static web site with nbconvert (or: make site).

    python tools/build_site.py notebooks site

- site/index.html: the students' README (tools/student_copies.py) under a line that says what
  the pages are, rendered, with its links to notebooks/*.ipynb pointing to the pages;
- site/NN_name.html: each notebook with its stored outputs (nothing is executed),
  solution cells removed, every figure with alt text, and previous / home / next links.

Before anything is written, every notebook must pass the check the hand-out shares
(tools/notebook_format.py): each exercise has exactly one solution cell under it, and no
solution text or output survives on the page; a notebook that breaks it, or cannot be read,
is refused with its name and cell. The pages are written to a temporary folder beside the
target and then moved into it, so the front page never links to a page that was not written.

The pages load nothing from the network (no require.js, MathJax or Mermaid: the notebooks
use none), so the site works offline and from file://. Links that have no page in the
site (the package's source) are kept as text.
"""

import argparse
import html
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import markdown2html_mistune
from nbconvert.preprocessors import Preprocessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_format import NotebookError, check_exercises, check_no_leaks, read_notebook, tags  # noqa: E402
from student_copies import student_readme  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = Path(__file__).resolve().parent / "site_template"  # extends nbconvert's lab template
_TITLE = re.compile(r"""(?:title|set_title|suptitle)\s*[=(]\s*f?(["'])(.+?)\1""")
_LINK = re.compile(r'<a href="([^"]*)">(.*?)</a>', re.DOTALL)
SITE_LINE = (
    "These pages show the course's notebooks as they ran once, with their outputs and without the "
    "exercises' solutions. To run them yourself, get the hand-out (`student.zip`) from your teacher "
    "and follow *Start* below."
)


def front_page_text() -> str:
    """The students' README with the site's own line under its title."""
    title, _, rest = student_readme().partition("\n")
    return f"{title}\n\n{SITE_LINE}\n{rest}"


def _plain(markdown: str) -> str:
    """Markdown as one line of plain text: no headings, emphasis, code marks or link targets."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"[#*`_]+", "", text)
    return " ".join(text.split())


def figure_alt(source: str, section: str) -> str:
    """Alt text for a figure: the titles its cell's code sets (f-string fields shown as '…'), and
    the section of the notebook it illustrates."""
    titles = [re.sub(r"\{[^}]*\}", "…", m.group(2)) for m in _TITLE.finditer(source)]
    text = "Figure: " + "; ".join(titles) if titles else "Figure"
    return f"{text} (section: {section})" if section else text + "."


class FigureAltText(Preprocessor):
    """Store alt text in each image output's metadata (`alt`), which the site's template writes out."""

    def preprocess(self, nb, resources):
        section = ""
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                headings = re.findall(r"^#+ (.+)$", cell.source, flags=re.MULTILINE)
                section = _plain(headings[-1]) if headings else section
            elif cell.cell_type == "code":
                for output in cell.get("outputs", []):
                    if any(k.startswith("image/") for k in output.get("data", {})):
                        output.setdefault("metadata", {})["alt"] = figure_alt(cell.source, section)
        return nb, resources


def notebook_title(nb) -> str:
    first = next((c.source for c in nb.cells if c.cell_type == "markdown"), "")
    return _plain(first.splitlines()[0]) if first else "Notebook"


def _short(title: str) -> str:
    return title.split(":")[0]


def navigation(pages: list[tuple[str, str]], index: int) -> str:
    """Previous / home / next links for page `index` of `pages` [(file name, title)]."""
    links = []
    if index > 0:
        name, title = pages[index - 1]
        links.append(f'<a rel="prev" href="{name}">&larr; {html.escape(_short(title))}</a>')
    links.append('<a rel="home" href="index.html">Course home</a>')
    if index < len(pages) - 1:
        name, title = pages[index + 1]
        links.append(f'<a rel="next" href="{name}">{html.escape(_short(title))} &rarr;</a>')
    return '<nav class="course-nav">' + " | ".join(links) + "</nav>"


def relink(page: str, existing: set[str], prefix: str = "") -> str:
    """Point links to notebooks (`prefix`NN_x.ipynb) at their pages; unwrap local links to files the
    site lacks. External links and in-page anchors are left alone."""

    def fix(match):
        target, text = match.groups()
        if re.match(r"^[a-z]+:|^#", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        if path.startswith(prefix) and path.endswith(".ipynb"):
            path = path[len(prefix) : -len(".ipynb")] + ".html"
        if path not in existing:
            return text
        return f'<a href="{path}{"#" + anchor if anchor else ""}">{text}</a>'

    return _LINK.sub(fix, page)


def _exporter() -> HTMLExporter:
    exporter = HTMLExporter(template_name=TEMPLATE_DIR.name, extra_template_basedirs=[str(TEMPLATE_DIR.parent)])
    exporter.register_preprocessor(FigureAltText(enabled=True), enabled=True)
    return exporter


def _front_page(readme: str, pages: list[tuple[str, str]], existing: set[str]) -> str:
    body = relink(markdown2html_mistune(readme), existing, prefix="notebooks/")
    items = "".join(f'<li><a href="{name}">{html.escape(title)}</a></li>' for name, title in pages)
    style = (TEMPLATE_DIR / "front.css").read_text()
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1.0">\n'
        f"<title>{html.escape(_plain(readme.splitlines()[0]))}</title>\n<style>{style}</style>\n</head>\n"
        f'<body>\n<main>\n{body}\n<h2 id="pages">The notebooks, rendered</h2>\n<ol>{items}</ol>\n</main>\n'
        "</body>\n</html>\n"
    )


def public_notebook(path: Path):
    """The notebook at `path` as the site shows it: solution cells (of any type) removed, after the
    shared checks; a NotebookError names the notebook and the cell."""
    original = read_notebook(path)
    check_exercises(original, path.name)
    public = {**original, "cells": [c for c in original["cells"] if "solution" not in tags(c)]}
    check_no_leaks(original, public, path.name)
    return nbformat.reads(json.dumps(public), as_version=4)  # as nbformat.read: sources joined


def _pages(source: Path):
    paths = sorted(source.glob("*.ipynb"))
    if not paths:
        raise NotebookError(f"no notebooks in {str(source)!r}")
    notebooks = [public_notebook(p) for p in paths]  # all checked before anything is written
    return [(p.stem + ".html", notebook_title(nb)) for p, nb in zip(paths, notebooks, strict=True)], notebooks


def build(source: Path, target: Path) -> list[Path]:
    """Write the site; return the paths of the pages written, the front page first."""
    if target.exists() and not target.is_dir():
        raise NotebookError(f"{target} is a file, not a folder: give a folder for the site (made if missing)")
    pages, notebooks = _pages(source)
    existing = {"index.html"} | {name for name, _ in pages}
    exporter = _exporter()
    texts = {"index.html": _front_page(front_page_text(), pages, existing)}
    for i, nb in enumerate(notebooks):
        resources = {"metadata": {"name": pages[i][1]}, "course_nav": navigation(pages, i)}
        body, _ = exporter.from_notebook_node(nb, resources=resources)
        texts[pages[i][0]] = relink(body, existing)
    target.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=target, prefix=".building-"))
    try:
        for name, text in texts.items():
            (building / name).write_text(text)
        for name in [*texts][1:] + ["index.html"]:  # the front page last: it links to the others
            os.replace(building / name, target / name)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return [target / name for name in texts]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="folder of the notebooks (notebooks)")
    parser.add_argument("target", type=Path, help="folder to write the site to (site)")
    args = parser.parse_args(argv)
    try:
        written = build(args.source, args.target)
    except NotebookError as err:
        sys.exit(f"build_site: {err}")
    print(f"wrote {len(written)} pages to {args.target}/; open {args.target / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
