"""The manual builds (``mkdocs build --strict``: a broken link or a stale API reference fails), its results
pages are what their JSON records give, and the README stays a front door."""

import subprocess
import sys
from pathlib import Path

from benchmarks import render_results

REPO = Path(__file__).resolve().parents[1]


def test_results_pages_are_generated_from_the_records():
    pages = render_results.render()
    assert {"index.md", "prefill.md", "compression.md", "tradeoff.md"} <= set(pages)
    for name, text in pages.items():
        path = REPO / "docs" / "results" / name
        assert path.exists() and path.read_text() == text, f"{path} is stale: python -m benchmarks.render_results"
    records = render_results.load(REPO / "docs" / "results" / "data")
    assert all(r["date"] and r["machine"] and r["command"] for r in records)
    assert sum(len(r["rows"]) for r in records) > 200  # the measurement tables moved out of the README


def test_a_record_naming_an_unknown_page_is_refused(tmp_path):
    (tmp_path / "x.json").write_text('{"title": "t", "page": "nowhere", "date": "d", "machine": "m", '
                                     '"command": "c", "rows": []}')
    try:
        render_results.load(tmp_path)
    except ValueError as e:
        assert "nowhere" in str(e) and "prefill" in str(e)
    else:
        raise AssertionError("an unknown page was accepted")


def test_mkdocs_builds_strict(tmp_path):
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("HybridLM") > 1


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "bash scripts/run.sh" in readme and "bash scripts/test.sh" in readme
