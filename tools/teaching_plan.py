"""The teaching plan: each notebook's core path and deep dives, from its Time line, in sessions.

    python tools/teaching_plan.py            print the plan's table (Markdown)
    python tools/teaching_plan.py --write    put it into README.md between its two markers

A session of SESSION_MINUTES takes consecutive notebooks' core paths up to CORE_MINUTES: the
rest is slack for setting up, restarting a kernel and questions. The deep dives are homework.
tests/test_teaching.py checks that the README holds exactly this table.
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_format import TIME  # noqa: E402  (one pattern for the Time line, in the format checker)

ROOT = Path(__file__).resolve().parents[1]
SESSION_MINUTES = 90
CORE_MINUTES = 75  # of each session's 90: 15 minutes of slack
START, END = "<!-- teaching plan: written by tools/teaching_plan.py -->", "<!-- end of the teaching plan -->"


class PlanError(ValueError):
    """A notebook whose first cell states no time."""


def notebook_times(path: Path) -> dict:
    """{'name', 'core', 'deep', 'core_sections', 'deep_sections'} from the notebook's Time line."""
    cells = json.loads(path.read_text())["cells"]
    head = "".join(cells[0]["source"]) if cells else ""
    match = TIME.search(head)
    if match:
        core, last_core, deep, first, last = match.groups()
        deep_sections = (f"{first}-{last}" if last else first) if first else "none"
        return {"name": path.stem, "core": int(core), "deep": int(deep or 0),
                "core_sections": f"1-{last_core}", "deep_sections": deep_sections}  # fmt: skip
    raise PlanError(f"{path.name}: cell 0 states no '**Time.** About N minutes on the core path ...' line")


WORDS_PER_MINUTE = 150


def core_reading_minutes(path: Path) -> float:
    """Minutes to read the prose of the notebook's core path (up to its first deep dive or its
    exercises) at WORDS_PER_MINUTE."""
    words = 0
    for cell in json.loads(path.read_text())["cells"]:
        text = "".join(cell["source"])
        headings = re.findall(r"^## (.+)$", text, re.MULTILINE) if cell["cell_type"] == "markdown" else []
        if any(h.endswith("(deep dive)") or h == "Exercises" for h in headings):
            break
        words += len(text.split()) if cell["cell_type"] == "markdown" else 0
    return words / WORDS_PER_MINUTE


def sessions(times: list[dict], limit: int = CORE_MINUTES) -> list[list[dict]]:
    """Consecutive notebooks, packed into sessions whose core paths add up to at most `limit`
    minutes (a notebook longer than that gets a session of its own)."""
    packed = [[]]
    for t in times:
        if packed[-1] and sum(x["core"] for x in packed[-1]) + t["core"] > limit:
            packed.append([])
        packed[-1].append(t)
    return [s for s in packed if s]


def plan_table(notebooks: Path = ROOT / "notebooks") -> str:
    times = [notebook_times(p) for p in sorted(notebooks.glob("*.ipynb"))]
    rows = [
        f"| session ({SESSION_MINUTES} min, at most {CORE_MINUTES} of core path) | notebook | core path | in class "
        "| deep dives (homework) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for number, session in enumerate(sessions(times), start=1):
        minutes = sum(t["core"] for t in session)
        for i, t in enumerate(session):
            label = f"{number} ({minutes} min)" if i == 0 else ""
            deep = f"sections {t['deep_sections']}, {t['deep']} min" if t["deep"] else "none"
            rows.append(f"| {label} | `{t['name']}` | sections {t['core_sections']} | {t['core']} min | {deep} |")
    core, deep = sum(t["core"] for t in times), sum(t["deep"] for t in times)
    rows.append(f"| **{len(sessions(times))} sessions** | **total** | | **{core} min** | **{deep} min** |")
    return "\n".join(rows) + "\n"


def readme_plan(readme: str) -> str:
    """The plan as the README holds it, between its markers ('' if there are none)."""
    if START not in readme or END not in readme:
        return ""
    return readme.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the table into README.md")
    args = parser.parse_args(argv)
    try:
        table = plan_table()
    except PlanError as err:
        sys.exit(f"teaching_plan: {err}")
    if not args.write:
        print(table, end="")
        return 0
    readme = (ROOT / "README.md").read_text()
    if START not in readme or END not in readme:
        sys.exit(f"teaching_plan: README.md has no markers {START!r} ... {END!r}; add them where the plan goes")
    before, rest = readme.split(START, 1)
    (ROOT / "README.md").write_text(before + START + "\n" + table + END + rest.split(END, 1)[1])
    print("teaching_plan: wrote the plan into README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
