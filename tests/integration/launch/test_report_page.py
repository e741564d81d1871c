"""The run's page (launch/report.py) in a real headless Chromium: a screenshot shows every
section, and the page's script lists the rollouts and filters them (by step, verdict, text).

``tests/data/run_small`` holds the files of a real run, copied as launch/run_all.sh wrote them:
``launch/run_all.sh --training-steps 3 --keep-constant-groups --eval-samples 8 --num-sessions 200
--sft-steps 3`` on an empty ``SHOP_R1_ARTIFACTS`` (a 3-step SFT model: its completions fail
the format check). tests/integration/launch/test_launch_run_all.py checks the page of a run made
during the test as well.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from launch.procs import REPO_ROOT
from tests.browser import check_report_screenshot, dom, screenshot

pytestmark = pytest.mark.integration
RUN = Path(__file__).parent.parents[1] / "data" / "run_small"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m launch.report`` on a copy of the recorded run."""
    run = tmp_path_factory.mktemp("report") / "run_small"
    shutil.copytree(RUN, run)
    done = subprocess.run(
        [sys.executable, "-m", "launch.report", str(run)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"wrote {run / 'report.html'}"
    return run / "report.html"


def _rollouts() -> list[dict]:
    return [json.loads(x) for x in (RUN / "trainer" / "rollouts.jsonl").read_text().splitlines()]


def _shown(html: str) -> int:
    return int(re.search(r'<span id="shown">(\d+)</span>', html).group(1))


def test_screenshot_shows_every_section(page: Path, tmp_path: Path) -> None:
    png = screenshot(page, tmp_path / "report.png")
    check_report_screenshot(png)


def test_script_lists_and_filters_the_rollouts(page: Path) -> None:
    rows = _rollouts()
    html = dom(page)
    assert f'data-ready="{len(rows)}"' in html and _shown(html) == len(rows)
    for section in ("summary", "eval", "curves", "confusion", "rollouts"):
        assert f'<section id="{section}">' in html
    assert "<svg" in html and "exact match" in html
    assert _shown(dom(page, "step=2")) == sum(r["step"] == 2 for r in rows) > 0
    assert _shown(dom(page, "verdict=exact")) == sum(bool(r["exact"]) for r in rows)
    assert _shown(dom(page, "verdict=invalid")) == sum(r["valid"] is False for r in rows)
    word = rows[0]["completion"][:10]
    expected = sum(word.lower() in (r["completion"] + r["prompt_tail"]).lower() for r in rows)
    assert 0 < _shown(dom(page, f"q={quote(word)}")) == expected


def test_missing_run_dir_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launch.report", str(tmp_path / "nope")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "no run directory" in done.stderr


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("", "no header band"),
        ('<header style="background:#1e3a5f;height:48px"></header>', "almost) blank"),
    ],
    ids=["blank", "header_only"],
)
def test_the_screenshot_check_rejects_a_page_that_did_not_render(
    tmp_path: Path, body: str, why: str
) -> None:
    page = tmp_path / "page.html"
    page.write_text(f"<!DOCTYPE html><html><body style='margin:0'>{body}</body></html>")
    png = screenshot(page, tmp_path / "page.png")
    with pytest.raises(AssertionError, match=re.escape(why)):
        check_report_screenshot(png)
