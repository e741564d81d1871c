"""A real headless Chromium for the tests of the run's page (launch/report.py): screenshots and
the DOM after the page's script ran. Debian's ``chromium`` is installed by
``tests/install_chromium.sh`` (run by ``make setup``, and here when it is missing)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

INSTALL = Path(__file__).with_name("install_chromium.sh")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium() -> str:
    """The Chromium executable; installs it (tests/install_chromium.sh) when missing."""
    for name in ("chromium", "chromium-browser"):
        if exe := shutil.which(name):
            return exe
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=900)
    for name in ("chromium", "chromium-browser"):
        if exe := shutil.which(name):
            return exe
    pytest.fail(f"no chromium and {INSTALL} could not install it:\n{done.stderr[-2000:]}")


def _run(args: Sequence[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        argv = [chromium(), *FLAGS, f"--user-data-dir={profile}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"chromium exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 2400) -> Path:
    """A ``width`` x ``height`` screenshot of ``page`` (a local file) into ``png``."""
    _run([f"--window-size={width},{height}", f"--screenshot={png}", page.resolve().as_uri()])
    assert png.exists() and png.stat().st_size > 0, f"chromium wrote no {png}"
    return png


def dom(page: Path, fragment: str = "") -> str:
    """The page's DOM after it loaded and its script ran (``fragment``: after ``#``)."""
    uri = page.resolve().as_uri() + (f"#{fragment}" if fragment else "")
    return _run(["--dump-dom", uri]).stdout


HEADER = (30, 58, 95)  # #1e3a5f, launch/report_assets.py
COLOURS = {
    "reward curve (running mean, C1)": (255, 127, 14),
    "format curve (C2)": (44, 160, 44),
    "confusion cell (darkest)": (45, 127, 185),
}


def _near(img: Any, colour: tuple[int, int, int], tol: int = 18) -> Any:
    """Boolean mask of the pixels of ``img`` (H x W x 3) within ``tol`` of ``colour``."""
    import numpy as np

    return (np.abs(img.astype(int) - np.array(colour)) <= tol).all(axis=-1)


def check_report_screenshot(png: Path) -> dict[str, int]:
    """A screenshot of report.html shows the page, not a blank or an error page: the header
    band on top, most of the page drawn, the curves and the confusion matrix in their
    colours, a rollout's verdict badge. Returns the pixel count of each colour found."""
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(png).convert("RGB"))
    band = _near(img[6:40], HEADER, 6).mean(axis=1)  # each row, less the title's text
    assert band.min() > 0.5, f"no header band on top (rows {band.round(2).tolist()})"
    background = _near(img, (244, 246, 249), 3) | _near(img, (255, 255, 255), 3)
    assert background.mean() < 0.9, "the page is (almost) blank"
    found = {}
    for name, colour in COLOURS.items():
        found[name] = int(_near(img, colour).sum())
        assert found[name] > 40, f"no {name} in the screenshot ({found[name]} px)"
    badges = [(198, 40, 40), (31, 119, 180), (46, 125, 50)]  # invalid / valid / exact
    found["badges"] = int(sum(_near(img, c, 10).sum() for c in badges))
    assert found["badges"] > 40, "no rollout verdict badge in the screenshot"
    return found
