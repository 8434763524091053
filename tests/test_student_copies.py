import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_student_copies_hide_solutions_and_outputs(tmp_path):
    result = subprocess.run(
        [sys.executable, "tools/student_copies.py", "notebooks", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    originals = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == [p.name for p in originals]
    for original in originals:
        source = json.loads(original.read_text())
        copy = json.loads((tmp_path / original.name).read_text())
        assert len(copy["cells"]) == len(source["cells"])
        for before, after in zip(source["cells"], copy["cells"], strict=True):
            if after["cell_type"] != "code":
                assert after["source"] == before["source"]
                continue
            assert after["outputs"] == [] and after["execution_count"] is None
            if "solution" in before["metadata"].get("tags", []):
                assert "".join(after["source"]).startswith("# Your solution here")
            else:
                assert after["source"] == before["source"]
