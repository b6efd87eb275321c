"""Headless Chromium driven over the DevTools protocol, for tests that click and type: no port, no library.

    with Browser(tmp_path) as browser:
        page = browser.open("http://127.0.0.1:PORT/")
        page.wait_for("document.documentElement.dataset.ready === '1'")
        page.click("#good"); page.key("g"); page.key("ArrowUp", shift=True); page.drag("#a", "#b")
        assert page.eval("document.title") == "..."

Chromium's `--remote-debugging-pipe` speaks the protocol on its file descriptors 3 (commands in) and 4 (replies
and events out), each message JSON ended by a NUL byte. A reader thread hands each reply to the command waiting
for it. Clicks, keys and drags are the input events a person's mouse and keyboard make (`Input.dispatch*Event`),
at the element's position on screen, so the page's own listeners handle them as they would a person's.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from tests.netguard import die_with_parent

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")  # Debian's package (`make browser`)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1280,900"]

# key -> (code, Windows virtual key code, text it types)
KEYS = {"Enter": ("Enter", 13, "\r"), "Escape": ("Escape", 27, ""), "ArrowUp": ("ArrowUp", 38, ""),
        "ArrowDown": ("ArrowDown", 40, ""), "?": ("Slash", 191, "?")}
SHIFT = 8  # the protocol's modifier bit


class Browser:
    """One Chromium with a fresh profile in `folder`; stopped (with its children) when the block ends."""

    def __init__(self, folder: Path):
        commands_r, commands_w = os.pipe()
        replies_r, replies_w = os.pipe()

        def fds() -> None:
            # In the child: its ends of the pipes become fds 3 and 4, by way of copies above both (either end may
            # be 3 or 4 already). dup2 leaves 3 and 4 inheritable; every other fd Python opened is close-on-exec,
            # so close_fds=False hands Chromium these two only.
            ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (commands_r, replies_w)]
            os.dup2(ends[0], 3)
            os.dup2(ends[1], 4)
            die_with_parent()

        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={folder / 'chromium-profile'}",
                                      "--remote-debugging-pipe", "about:blank"], preexec_fn=fds, close_fds=False,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(commands_r)
        os.close(replies_w)
        self._out, self._in = os.fdopen(commands_w, "wb", buffering=0), os.fdopen(replies_r, "rb", buffering=0)
        self._next, self._lock = 0, threading.Lock()
        self._waiting: dict[int, list[Any]] = {}  # id -> [event, reply]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        while chunk := self._in.read(65536):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                slot = self._waiting.get(message.get("id"))
                if slot is not None:
                    slot[1] = message
                    slot[0].set()

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict[str, Any]:
        """One protocol command; its result (AssertionError with the protocol's error)."""
        with self._lock:
            self._next += 1
            ident = self._next
            slot = self._waiting[ident] = [threading.Event(), None]
            message = {"id": ident, "method": method, "params": params or {}} | ({"sessionId": session} if session else {})
            self._out.write(json.dumps(message).encode() + b"\0")
        assert slot[0].wait(timeout), f"no reply to {method} in {timeout} s"
        reply = self._waiting.pop(ident)[1]
        assert "error" not in reply, f"{method}: {reply['error']}"
        return reply["result"]

    def open(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        page = Page(self, self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"])
        page.send("Page.enable")
        page.goto(url)
        return page

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except AssertionError:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self._out.close()


class Page:
    """One tab: evaluate script, wait for a condition, and send a person's input."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def reload(self) -> None:
        self.eval("delete document.documentElement.dataset.ready")
        self.send("Page.reload", {"ignoreCache": True})

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression (a promise is awaited); AssertionError if it throws."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll `expression` until it is truthy (returns it); fail naming it and any script error the page recorded."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except AssertionError:  # the page is between documents (a reload)
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                state = self.eval("JSON.stringify(document.documentElement.dataset)")
                raise AssertionError(f"timed out waiting for {expression} (page state {state})")
            time.sleep(0.05)

    def center(self, selector: str) -> tuple[float, float]:
        box = self.eval(f"(function(){{var e=document.querySelector({json.dumps(selector)});if(!e)return null;"
                        "e.scrollIntoView({block:'center'});var r=e.getBoundingClientRect();"
                        "return [r.left+r.width/2, r.top+r.height/2]})()")
        assert box, f"no element {selector} on the page"
        return box[0], box[1]

    def _mouse(self, kind: str, x: float, y: float, buttons: int = 0) -> None:
        self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left" if kind != "mouseMoved" or
                                               buttons else "none", "buttons": buttons, "clickCount": 1})

    def click(self, selector: str) -> None:
        x, y = self.center(selector)
        self._mouse("mouseMoved", x, y)
        self._mouse("mousePressed", x, y, 1)
        self._mouse("mouseReleased", x, y)

    def drag(self, source: str, target: str, steps: int = 5) -> None:
        """Press on `source`, move in `steps` to `target`'s centre, release there."""
        (x0, y0), (x1, y1) = self.center(source), self.center(target)
        self._mouse("mouseMoved", x0, y0)
        self._mouse("mousePressed", x0, y0, 1)
        for i in range(1, steps + 1):
            self._mouse("mouseMoved", x0 + (x1 - x0) * i / steps, y0 + (y1 - y0) * i / steps, 1)
        self._mouse("mouseReleased", x1, y1)

    def key(self, key: str, shift: bool = False) -> None:
        """Press and release one key: a letter or digit, or one of KEYS."""
        if key in KEYS:
            code, vk, text = KEYS[key]
        else:
            code, vk, text = (f"Digit{key}" if key.isdigit() else f"Key{key.upper()}"), ord(key.upper()), key
        event = {"key": key, "code": code, "windowsVirtualKeyCode": vk, "modifiers": SHIFT if shift else 0}
        self.send("Input.dispatchKeyEvent", {"type": "keyDown", **event, **({"text": text} if text else {})})
        self.send("Input.dispatchKeyEvent", {"type": "keyUp", **event})

    def type(self, text: str) -> None:
        """Type `text` into the focused field."""
        self.send("Input.insertText", {"text": text})
