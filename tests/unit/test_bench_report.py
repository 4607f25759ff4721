"""The generated performance page and README's summary equal what ``python -m
bench.report`` builds from bench/results/ (a page left stale after a benchmark run
fails here), and the README stays a first visit's page: at most 25 KB, with the two
commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", report.PAGES)
def test_generated_blocks_are_up_to_date(page: str) -> None:
    path = ROOT / page
    expected = report.generate(ROOT)[path]
    assert path.read_text(encoding="utf-8") == expected, (
        f"{page} is stale: run `.venv/bin/python -m bench.report` and commit it")


def test_every_block_is_used_and_every_table_of_the_performance_page_is_generated() -> None:
    used = set()
    for page in report.PAGES:
        used |= set(re.findall(r"<!-- bench:([a-z0-9_]+):start -->",
                               (ROOT / page).read_text(encoding="utf-8")))
    assert used == set(report.BLOCKS)
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    outside = re.sub(r"<!-- bench:([a-z0-9_]+):start -->.*?<!-- bench:\1:end -->", "", text,
                     flags=re.S)
    assert [ln for ln in outside.splitlines() if ln.startswith("|")] == []


def test_readme_quotes_one_table_and_it_is_generated() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- bench:([a-z0-9_]+):start -->", text)
    assert blocks == ["summary"]
    summary = re.search(r"<!-- bench:summary:start -->(.*?)<!-- bench:summary:end -->", text,
                        re.S).group(1)
    assert "bq-zh" in summary and "from `bench/results/cache_quality.json`" in summary.lower()


def test_a_block_names_its_source_commit_date_and_load(tmp_path: Path) -> None:
    """A result file lacking a field says "not recorded" instead."""
    (tmp_path / "admission.json").write_text(json.dumps({
        "meta": {"command": "python -m bench.admission"},
        "runs": [{"shedding": "on", "offered_rps": 24.5, "requests": 10, "ok": 6,
                  "shed_rate": 0.4, "timeout_rate": 0.0, "error_rate": 0.0}]}))
    out = report.render("a\n<!-- bench:admission:start -->\nold\n<!-- bench:admission:end -->\nb\n",
                        tmp_path)
    assert out.startswith("a\n<!-- bench:admission:start -->\nFrom `bench/results/admission.json`")
    assert "commit not recorded, date not recorded, load average (1 min) not recorded" in out
    assert "| on       |" in out and "old" not in out and out.endswith("<!-- bench:admission:end -->\nb\n")
    meta = {"started": "2026-12-04T04:21:45+0000", "machine": {"commit": "c08feff", "loadavg_1m": 0.31},
            "loadavg_after": 0.5}
    assert report.provenance("x.json", meta) == (
        "From `bench/results/x.json`: commit `c08feff`, date 2026-12-04T04:21:45+0000, "
        "load average (1 min) 0.31 at the start, 0.5 after.")


def test_unknown_or_unclosed_blocks_and_missing_results_are_refused(tmp_path: Path) -> None:
    with pytest.raises(report.ReportError, match="unknown block"):
        report.render("<!-- bench:nope:start -->\n<!-- bench:nope:end -->", tmp_path)
    with pytest.raises(report.ReportError, match="without its end"):
        report.render("<!-- bench:summary:start -->\n", tmp_path)
    with pytest.raises(report.ReportError, match="result file missing"):
        report.render("<!-- bench:summary:start -->\n<!-- bench:summary:end -->", tmp_path)


def test_check_mode_reports_a_stale_page_and_a_run_rewrites_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for page in report.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text(encoding="utf-8"), encoding="utf-8")
    run = {"root": tmp_path, "results": report.RESULTS}
    assert report.main(["--check"], **run) == 0
    stale = tmp_path / "README.md"
    stale.write_text(stale.read_text(encoding="utf-8").replace("| bq-zh ", "| bq-zh (edited) "),
                     encoding="utf-8")
    assert report.main(["--check"], **run) == 1
    assert "stale: README.md" in capsys.readouterr().out
    assert report.main([], **run) == 0
    assert "wrote README.md" in capsys.readouterr().out
    assert stale.read_text(encoding="utf-8") == (ROOT / "README.md").read_text(encoding="utf-8")
    assert report.main(["--check"], root=tmp_path, results=tmp_path) == 2  # no result files


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    path = ROOT / "README.md"
    assert path.stat().st_size <= 25 * 1024
    text = path.read_text(encoding="utf-8")
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    assert ".venv/bin/infergate up" in lines
    assert ".venv/bin/pytest" in lines                       # exactly what .ci/run calls
    assert ".venv/bin/pytest" in (ROOT / ".ci" / "run").read_text().splitlines()
    assert '`.venv/bin/pytest -m "not integration"`' in text
    assert "infergate cache calibrate" in text.split("## Quick start")[0]
