"""`make site`: the course as static pages, checked as files and in a real headless browser."""

import html
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

_spec = importlib.util.spec_from_file_location("build_site", ROOT / "tools" / "build_site.py")
build_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_site)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    build_site.build(ROOT / "notebooks", target)
    return target


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _is_solution(cell: dict) -> bool:
    return "solution" in cell["metadata"].get("tags", [])


def _figures(path: Path) -> int:
    """Image outputs of the cells the site shows (solutions are removed)."""
    return sum(
        any(k.startswith("image/") for k in out.get("data", {}))
        for cell in _cells(path)
        if cell["cell_type"] == "code" and not _is_solution(cell)
        for out in cell["outputs"]
    )


class _Page(HTMLParser):
    """The links, images, script sources and visible text of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.links, self.images, self.scripts, self.text = [], [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a" and "href" in attrs:
            self.links.append(attrs["href"])
        elif tag == "img":
            self.images.append(attrs)
        elif tag == "script" and "src" in attrs:
            self.scripts.append(attrs["src"])

    def handle_data(self, data):
        self.text.append(data)


def _page(site: Path, name: str) -> _Page:
    return _Page((site / name).read_text())


def _pages() -> list[str]:
    return ["index.html"] + [p.stem + ".html" for p in NOTEBOOKS]


@pytest.mark.slow
def test_front_page_is_the_students_readme_with_links_to_every_page(site):
    page = _page(site, "index.html")
    text = " ".join(page.text)
    for heading in re.findall(r"^## (.+)$", build_site.front_page_text(), flags=re.MULTILINE):
        assert build_site._plain(heading) in text, f"README section {heading!r} is missing from the front page"
    assert "make test" not in text and "For contributors" not in text, "the front page is the teacher's README"
    for path in NOTEBOOKS:
        assert f"{path.stem}.html" in page.links, f"the front page does not link to {path.stem}.html"


@pytest.mark.slow
def test_the_site_names_only_what_the_handout_and_its_readme_hold(site, tmp_path):
    """tools/handout_refs.py on the pages' text: paths and `make x` the hand-out lacks, README
    sections its README lacks, solutions promised (the site removes them)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import handout_refs
    import student_copies

    handout = tmp_path / "student"
    student_copies.write_handout(ROOT / "notebooks", handout, tmp_path / "student.zip")
    found = handout_refs.check(handout, site)
    assert found == [], "\n".join(found)


@pytest.mark.slow
def test_every_link_works_offline_and_none_points_at_a_notebook_file(site):
    for name in _pages():
        page = _page(site, name)
        assert not page.scripts, f"{name} loads scripts from {page.scripts}: the site must work offline"
        for link in page.links:
            if re.match(r"^[a-z]+:|^#", link):
                continue
            target = link.split("#")[0]
            assert not target.endswith(".ipynb"), f"{name} links to a notebook file: {link}"
            assert (site / target).is_file(), f"{name} links to {link}, which the site does not have"


@pytest.mark.slow
def test_each_notebook_page_links_to_previous_home_and_next(site):
    names = [p.stem + ".html" for p in NOTEBOOKS]
    for i, name in enumerate(names):
        nav = re.search(r'<nav class="course-nav">(.*?)</nav>', (site / name).read_text()).group(1)
        expected = ([names[i - 1]] if i > 0 else []) + ["index.html"] + ([names[i + 1]] if i + 1 < len(names) else [])
        assert re.findall(r'href="([^"]+)"', nav) == expected, name


def test_links_inside_notebooks_stay_in_the_folder_jupyterlab_serves():
    """`make lab` serves notebooks/, so a link such as ../README.md is a 404 there."""
    for path in NOTEBOOKS:
        for cell in _cells(path):
            if cell["cell_type"] == "markdown":
                for target in re.findall(r"\]\(([^)#]+)", "".join(cell["source"])):
                    if not re.match(r"^[a-z]+:", target):
                        assert (path.parent / target).is_file() and "/" not in target, f"{path.name}: {target}"


def _solution_only_lines() -> set[str]:
    solution, elsewhere = set(), set()
    for path in NOTEBOOKS:
        for cell in _cells(path):
            lines = {line.strip() for line in cell["source"]}
            if cell["cell_type"] == "code" and _is_solution(cell):
                solution |= {line for line in lines if len(line) >= 25}
            else:
                elsewhere |= lines
            for out in cell.get("outputs", []):  # printed source, such as a module's function
                elsewhere |= {line.strip() for line in "".join(out.get("text", "")).splitlines()}
    for path in (ROOT / "tutorial_lib").glob("*.py"):
        elsewhere |= {line.strip() for line in path.read_text().splitlines()}
    shown = "\n".join(elsewhere)  # a solution line inside a longer lesson line is no leak either
    return {line for line in solution - elsewhere if line not in shown}


@pytest.mark.slow
def test_pages_show_no_solution(site):
    lines = _solution_only_lines()
    assert len(lines) > 20
    for name in _pages():
        text = html.unescape("".join(_page(site, name).text))
        leaked = [line for line in lines if line in text]
        assert not leaked, f"{name} shows solution code: {leaked[:2]}"


@pytest.mark.slow
def test_every_figure_is_on_its_page_with_alt_text(site):
    for path in NOTEBOOKS:
        images = _page(site, path.stem + ".html").images
        assert len(images) == _figures(path), path.name
        for image in images:
            assert image.get("alt", "").startswith("Figure") and len(image["alt"]) > 20, (path.name, image.get("alt"))


def test_alt_text_names_the_titles_and_the_section():
    source = 'ax.set(title="Throughput", xlabel="k")\nax2.set_title(f"{n} devices")'
    assert build_site.figure_alt(source, "5. Speed") == "Figure: Throughput; … devices (section: 5. Speed)"
    assert build_site.figure_alt("plt.plot(x)", "") == "Figure."


# The browser check: every page rendered by Chromium, headless.

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
needs_browser = pytest.mark.skipif(
    BROWSER is None,
    reason="no Chromium found (chromium, chromium-browser or google-chrome on PATH); "
    ".ci/run installs it, or: apt-get install chromium",
)


def _render(page: Path, profile: Path) -> tuple[str, list[str]]:
    """The DOM Chromium built for `page` after it loaded, and the console messages it logged."""
    result = subprocess.run(
        [BROWSER, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={profile}",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    return result.stdout, console


@needs_browser
@pytest.mark.slow
def test_the_browser_check_sees_a_script_error_and_a_missing_figure(tmp_path):
    """The checks below can fail: a page that throws, and a figure that cannot be decoded."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<html><body><img alt="Figure: broken" src="data:image/png;base64,AAAA"><script>'
        "addEventListener('load', () => { document.body.dataset.figuresDecoded = "
        "[...document.images].filter((i) => i.complete && i.naturalWidth > 0).length; });"
        "throw new Error('boom');</script></body></html>"
    )
    dom, console = _render(page, tmp_path / "profile")
    assert any("Uncaught Error: boom" in line for line in console), console
    assert 'data-figures-decoded="0"' in dom


@needs_browser
@pytest.mark.slow
def test_every_page_renders_in_chromium_with_its_figures_and_no_script_error(site, tmp_path):
    names = _pages()
    with ThreadPoolExecutor(max_workers=3) as pool:
        rendered = list(pool.map(lambda n: _render(site / n, tmp_path / f"profile-{n}"), names))
    for name, (dom, console) in zip(names, rendered, strict=True):
        assert "<main" in dom and len(dom) > 5000, f"{name}: Chromium rendered an almost empty page"
        assert not console, f"{name}: the browser console says {console}"
    for path, (dom, _) in zip(NOTEBOOKS, rendered[1:], strict=True):
        decoded = re.search(r'data-figures-decoded="(\d+)"', dom)
        assert decoded, f"{path.stem}.html: the page's script did not run"
        assert int(decoded.group(1)) == _figures(path), f"{path.stem}.html: figures decoded {decoded.group(1)}"
    assert sum(_figures(p) for p in NOTEBOOKS) > 0, "no figure was checked"


def _one_notebook(tmp_path, edit=None, text=None):
    """A folder with notebook 06 (edited), for the site to be built from."""
    source = tmp_path / "notebooks"
    source.mkdir()
    notebook = json.loads((ROOT / "notebooks" / "06_scaling.ipynb").read_text())
    if edit:
        edit(notebook)
    (source / "06_scaling.ipynb").write_text(text if text is not None else json.dumps(notebook))
    return source


def _misspell_first_solution(notebook):
    cell = next(c for c in notebook["cells"] if "solution" in c["metadata"].get("tags", []))
    cell["metadata"]["tags"] = ["solutoin"]


@pytest.mark.parametrize(
    "edit, text, message",
    [
        (_misspell_first_solution, None, r"06_scaling.ipynb: cell \d+ \(### Exercise 1 .* not followed"),
        (None, '{"cells": [', "06_scaling.ipynb: not a readable notebook"),
        (None, '{"cells": [{"cell_type": "markdown"}]}', "06_scaling.ipynb: cell 0 has no cell_type or no source"),
    ],
)
def test_a_notebook_that_would_leak_or_cannot_be_read_is_refused_and_nothing_written(tmp_path, edit, text, message):
    source = _one_notebook(tmp_path, edit, text)
    with pytest.raises(SystemExit) as stopped:  # the message, not a traceback
        build_site.main([str(source), str(tmp_path / "site")])
    assert re.search(message, str(stopped.value.code)), stopped.value.code
    assert not (tmp_path / "site").exists() or not any((tmp_path / "site").iterdir())


def test_a_markdown_solution_is_not_published(tmp_path):
    def answer_in_markdown(notebook):
        cell = next(c for c in notebook["cells"] if "solution" in c["metadata"].get("tags", []))
        cell.update(cell_type="markdown", source=["The answer is: exactly forty-two transformers.\n"])
        cell.pop("outputs"), cell.pop("execution_count")

    source = _one_notebook(tmp_path, answer_in_markdown)
    build_site.build(source, tmp_path / "site")
    assert "forty-two transformers" not in (tmp_path / "site" / "06_scaling.html").read_text()


def test_a_cell_with_null_metadata_builds_and_a_target_that_is_a_file_is_refused(tmp_path):
    def null_metadata(notebook):
        notebook["cells"][3]["metadata"] = None

    source = _one_notebook(tmp_path, null_metadata)
    assert (tmp_path / "site" / "06_scaling.html") in build_site.build(source, tmp_path / "site")
    (tmp_path / "site.html").write_text("mine")
    with pytest.raises(SystemExit) as stopped:  # the message, not a traceback, before any page is rendered
        build_site.main([str(source), str(tmp_path / "site.html")])
    assert "site.html is a file, not a folder" in str(stopped.value.code)
    assert (tmp_path / "site.html").read_text() == "mine"
