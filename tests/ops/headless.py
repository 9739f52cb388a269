"""A real headless Chromium driven over the DevTools protocol on a pipe: no extra package.

``chromium --remote-debugging-pipe`` reads JSON commands on file descriptor 3 and writes answers
on 4, each message ended by a NUL byte. That is all a test needs to set the viewport exactly
(headless Chromium's window is 500 px wide at least, so ``--window-size=390,...`` cannot show a
phone), load a page, read what the browser laid out (``Runtime.evaluate`` runs in the page but is
not subject to its Content-Security-Policy, so the dashboard keeps its strict one) and take a
screenshot. Every call has a deadline; the browser is killed on close.
"""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

#: Layout facts of the loaded page: horizontal overflow and the elements sticking out on the right.
OVERFLOW_JS = """(() => {
  const d = document.documentElement, w = d.clientWidth;
  const wide = [];
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width && r.right > w + 1) wide.push(el.tagName.toLowerCase() + (el.className ? '.' + el.className : '')
                                              + ' right=' + Math.round(r.right));
    if (wide.length >= 10) break;
  }
  return {clientWidth: w, scrollWidth: d.scrollWidth, bodyScrollWidth: document.body.scrollWidth,
          innerWidth: window.innerWidth, wide: wide};
})()"""


def chromium_path() -> str:
    """The browser binary itself (Debian's ``/usr/bin/chromium`` is a shell script around it)."""
    for candidate in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if candidate and os.path.exists(candidate):
            return candidate
    pytest.fail("the dashboard tests need a real headless browser: install Debian's chromium package "
                "(apt-get install -y chromium; .ci/run does this)", pytrace=False)


class Browser:
    """One headless Chromium and one page (tab) in it."""

    def __init__(self, profile: Path, timeout: float = 60.0) -> None:
        self.timeout = timeout
        to_browser_r, self._w = os.pipe()
        self._r, from_browser_w = os.pipe()

        def fds() -> None:  # in the child: the protocol's descriptors 3 (commands) and 4 (answers)
            a, b = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(a, 3)
            os.dup2(b, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self._log = open(profile.parent / f"{profile.name}.log", "wb")
        self.proc = subprocess.Popen(
            [chromium_path(), "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
             "--no-first-run", "--hide-scrollbars", "--mute-audio", f"--user-data-dir={profile}",
             "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, close_fds=False, preexec_fn=fds)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=self.session)

    def call(self, method: str, params: Optional[Dict[str, Any]] = None, *, session: Optional[str] = None) -> Any:
        self._id += 1
        msg: Dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer {method} within {self.timeout} s")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise EOFError(f"chromium closed its pipe during {method}")
                self._buf += chunk

    def page(self, method: str, params: Optional[Dict[str, Any]] = None) -> Any:
        return self.call(method, params, session=self.session)

    def open(self, url: str, width: int, height: int, *, mobile: bool = False) -> None:
        """Load *url* in a viewport of exactly *width* x *height* CSS pixels and wait for its load."""
        self.page("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
        self.page("Page.navigate", {"url": url})
        deadline = time.monotonic() + self.timeout
        while self.evaluate("document.readyState") != "complete" or self.evaluate("location.href") == "about:blank":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load within {self.timeout} s")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        result = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML")

    def overflow(self) -> Dict[str, Any]:
        return self.evaluate(OVERFLOW_JS)

    def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        params: Dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size[0], "height": min(size[1], 6000), "scale": 1})
        data = self.page("Page.captureScreenshot", params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()
