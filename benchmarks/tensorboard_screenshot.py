"""Open TensorBoard's Custom Scalars dashboard in a headless browser: the charts in the order shown, and a PNG.

Starts a real ``tensorboard`` server on a free localhost port for LOGDIR, loads
``/#custom_scalars`` in headless Chromium (Debian: ``apt-get install chromium``), driven through
the DevTools protocol (the ``websockets`` package), waits until the charts have drawn, and prints
the chart titles in the order they appear on the page (top to bottom, left to right; TensorBoard
draws them inside shadow roots, which ``chromium --dump-dom`` does not serialise), then saves a
screenshot::

    python benchmarks/tensorboard_screenshot.py runs/demo -o custom_scalars.png

``tests/sinks/test_tensorboard_layout_browser.py`` uses :func:`custom_scalars_charts` to check
that the paper's figure is the first chart.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: the browser binaries tried, in order
BROWSERS = ("chromium", "chromium-browser", "google-chrome")

#: the browser window (width, height)
VIEWPORT = (1400, 1000)

#: every chart card of the dashboard, through the shadow roots, with its title, position and plotted runs
_CHARTS_JS = r"""
(() => {
  const found = [];
  const paths = (root) => {  // plotted lines, through the nested shadow roots of a card
    let n = 0;
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName.toLowerCase() === 'path') n += 1;
      if (el.shadowRoot) n += paths(el.shadowRoot);
    }
    return n;
  };
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      const name = el.tagName.toLowerCase();
      if (name === 'tf-custom-scalar-margin-chart-card' || name === 'tf-custom-scalar-multi-line-chart-card') {
        const r = el.getBoundingClientRect();
        found.push({title: el.title || '', kind: name.includes('margin') ? 'Margin' : 'Multiline',
                    top: r.top, left: r.left, width: r.width, height: r.height,
                    svg: el.shadowRoot ? paths(el.shadowRoot) : 0});
      }
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return JSON.stringify(found);
})()
"""


def find_browser() -> str | None:
    """The path of a Chromium-like browser, or None."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline: float, proc: subprocess.Popen) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in time")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def tensorboard_server(logdir: str | os.PathLike[str], timeout: float = 60.0) -> Iterator[str]:
    """A real ``tensorboard`` for ``logdir`` on a free localhost port; yields its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", os.fspath(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/data/plugins_listing", time.monotonic() + timeout, proc)
        yield base
    finally:
        _stop(proc)


class _DevTools:
    """A minimal DevTools-protocol client of one page (``websockets``' synchronous client)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})



@contextlib.contextmanager
def headless_page(browser: str, timeout: float = 30.0) -> Iterator[_DevTools]:
    """A headless browser with one blank page, driven through the DevTools protocol."""
    port = free_port()
    profile = tempfile.mkdtemp(prefix="attn_probe_browser_")
    proc = subprocess.Popen(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--no-default-browser-check", f"--remote-debugging-port={port}",
         f"--user-data-dir={profile}", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        from websockets.sync.client import connect

        deadline = time.monotonic() + timeout
        _wait_http(f"http://127.0.0.1:{port}/json/version", deadline, proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as resp:
            pages = [t for t in json.loads(resp.read()) if t.get("type") == "page"]
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=64 * 2**20) as ws:
            yield _DevTools(ws)
    finally:
        _stop(proc)
        shutil.rmtree(profile, ignore_errors=True)


def custom_scalars_charts(logdir: str | os.PathLike[str], screenshot: str | os.PathLike[str] | None = None, *,
                          browser: str | None = None, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The Custom Scalars charts of ``logdir`` as a browser shows them: ``title``, ``kind``, position.

    Sorted by their place on the page (top, then left). Waits until every chart card has drawn
    its plot (or ``timeout``); writes a PNG of the page to ``screenshot`` when given.
    """
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError(f"no headless browser found (tried {', '.join(BROWSERS)})")
    with tensorboard_server(logdir, timeout=timeout) as base, headless_page(browser, timeout=timeout) as page:
        page.call("Page.enable")
        page.call("Page.navigate", url=f"{base}/#custom_scalars")
        deadline = time.monotonic() + timeout
        charts: list[dict[str, Any]] = []
        settled = 0
        while time.monotonic() < deadline:
            value = page.call("Runtime.evaluate", expression=_CHARTS_JS, returnByValue=True)["result"].get("value")
            charts = json.loads(value or "[]")
            # the charts in view have drawn (TensorBoard draws those below the fold when scrolled to)
            in_view = [c for c in charts if c["top"] < VIEWPORT[1]]
            drawn = bool(in_view) and all(c["svg"] > 0 and c["height"] > 0 for c in in_view)
            settled = settled + 1 if drawn else 0
            if settled >= 3:  # the same, drawn, three polls in a row
                break
            time.sleep(0.5)
        if screenshot is not None:
            shot = page.call("Page.captureScreenshot", format="png")
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
    return sorted(charts, key=lambda c: (round(c["top"]), round(c["left"])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir")
    parser.add_argument("-o", "--output", default="custom_scalars.png", help="the screenshot (PNG)")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    charts = custom_scalars_charts(args.logdir, args.output, timeout=args.timeout)
    for i, c in enumerate(charts, 1):
        print(f"{i}. {c['title']} ({c['kind']}, at x={c['left']:.0f}, y={c['top']:.0f})")
    print(f"screenshot: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
