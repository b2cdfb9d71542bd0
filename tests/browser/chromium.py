"""Headless Chromium (Debian's chromium) rendering a page as a browser shows it. A helper module:
tests import it, never each other."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def render_page(url: str, *, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran (the UI is a single-page app), and optionally a
    screenshot of it."""
    args = [
        chromium_path(),
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1440,900",
        "--virtual-time-budget=15000",
    ]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        raise RuntimeError("Debian's chromium is needed for the browser test: apt-get install chromium (.ci/run does)")
    return found
