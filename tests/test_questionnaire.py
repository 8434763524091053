"""Every notebook ends with a questionnaire, and every question has an answer in the teacher's file."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ANSWERS = ROOT / "teacher" / "answers.md"
NUMBERED = re.compile(r"^(\d+)\. \S", re.MULTILINE)  # "3. text" at the start of a line


def _numbers(text: str) -> list[int]:
    return [int(n) for n in NUMBERED.findall(text)]


def _questionnaire(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    last = "".join(cells[-1]["source"])
    assert cells[-1]["cell_type"] == "markdown" and last.startswith("## Questionnaire"), (
        f"{path.name}: the last cell must be the '## Questionnaire' markdown cell"
    )
    summary = max(i for i, c in enumerate(cells) if "## Summary" in "".join(c["source"]))
    assert summary == len(cells) - 2, f"{path.name}: the questionnaire must come right after the Summary"
    return last


def _answer_sections() -> dict[str, str]:
    parts = re.split(r"^## (\S+)\s*$", ANSWERS.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_questionnaire_has_8_to_12_numbered_questions_each_answered(path):
    questions = _numbers(_questionnaire(path))
    assert 8 <= len(questions) <= 12, f"{path.name}: {len(questions)} questions, the course asks for 8 to 12"
    assert questions == list(range(1, len(questions) + 1)), f"{path.name}: questions numbered {questions}"
    sections = _answer_sections()
    assert path.stem in sections, f"teacher/answers.md has no '## {path.stem}' section"
    answers = _numbers(sections[path.stem])
    assert answers == questions, (
        f"{path.name} has questions {questions} but teacher/answers.md answers {answers}: "
        "give every question exactly one numbered answer"
    )


def test_answers_file_has_no_section_for_a_missing_notebook():
    assert set(_answer_sections()) == {p.stem for p in NOTEBOOKS}


def test_numbering_parser_sees_what_a_reader_sees():
    text = "1. first\n   continued 2. not a number\n2. second\n\n10. tenth"
    assert _numbers(text) == [1, 2, 10]
