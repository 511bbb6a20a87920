"""Headless Chromium (Debian's `chromium`) driven from the command line: DOM dumps and screenshots."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

WINDOW = (1600, 2400)


def chromium_binary() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("headless Chromium is required: apt-get install -y chromium")
    return found


def _run(page: Path, profile: Path, *mode: str) -> str:
    args = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        "--run-all-compositor-stages-before-draw",
        "--virtual-time-budget=3000",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        *mode,
        page.resolve().as_uri(),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=90, check=False)
    if done.returncode != 0:
        raise AssertionError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def dump_dom(page: Path, profile: Path) -> str:
    """The DOM after the page's scripts ran."""
    return _run(page, profile, "--dump-dom")


def screenshot(page: Path, profile: Path, png: Path) -> Path:
    _run(page, profile, f"--screenshot={png}")
    if not png.exists():
        raise AssertionError("chromium wrote no screenshot")
    return png
