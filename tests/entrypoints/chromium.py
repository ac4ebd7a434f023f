"""Headless Chromium for the web UI tests, driven over the DevTools protocol (CDP) on a
websocket (`websocket-client`): start the browser, evaluate JavaScript in the page, type with
real input events, click with real mouse events, take screenshots.

The browser is Debian's `chromium` (or `$CHROMIUM`), which `make test` installs when it is
missing (`scripts/install_chromium.sh`); `INSTALL_HINT` says how.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

INSTALL_HINT = (
    "the web UI test needs Chromium: `make test` installs it (scripts/install_chromium.sh: "
    "`apt-get install -y --no-install-recommends chromium` on Debian/Ubuntu, as root or with "
    "sudo), or set $CHROMIUM to a Chromium/Chrome binary"
)
START_TIMEOUT_S = 30


def browser_path() -> str | None:
    """The Chromium binary to run: `$CHROMIUM`, else the first of the usual names on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    """A DevTools command failed, or the page's JavaScript threw."""


class Page:
    """One page target over its DevTools websocket: commands are sent one at a time and
    their replies awaited; the events received meanwhile are kept in `events`."""

    def __init__(self, ws_url: str) -> None:
        import websocket  # websocket-client, a dev extra

        # Chromium refuses DevTools websockets with an Origin it was not told to allow.
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Runs one DevTools command and returns its result."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise CDPError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 15.0) -> dict[str, Any]:
        """The first event named `method` not yet taken (read off the socket if need be)."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event["method"] == method:
                    self.events.remove(event)
                    return event["params"]
            self.ws.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                msg = json.loads(self.ws.recv())
            except Exception as err:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"timed out waiting for {method}") from err
                raise
            finally:
                self.ws.settimeout(30)
            if "method" in msg:
                self.events.append(msg)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"{expression!r} threw: {text}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15.0, what: str = "") -> Any:
        """Polls a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what or expression}")
            time.sleep(0.05)

    def navigate(self, url: str) -> None:
        """Opens `url` and waits until its document has loaded."""
        self.send("Page.navigate", url=url)
        self.wait_for(
            f"location.href.startsWith({json.dumps(url)}) && document.readyState === 'complete'",
            what=f"{url} to load",
        )

    def click(self, selector: str) -> None:
        """Clicks the middle of the element with real mouse events (press, release)."""
        rect = self.eval(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            " el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()"
        )
        x, y = rect["x"], rect["y"]
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_into(self, selector: str, text: str) -> None:
        """Focuses the field, selects what it holds and types `text` over it (input events)."""
        self.eval(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            " el.focus(); el.select(); })()"
        )
        self.send("Input.insertText", text=text)
        # `change` fires on blur, as when a user leaves the field.
        self.eval(f"document.querySelector({json.dumps(selector)}).blur()")

    def text(self, selector: str) -> str | None:
        """The `textContent` of the element, or None when there is none."""
        return self.eval(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            " return el ? el.textContent : null; })()"
        )

    def screenshot(self, path: str) -> None:
        """Saves a PNG of the viewport."""
        data = self.send("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def problems(self) -> list[str]:
        """Uncaught exceptions and security messages (CSP violations) the page reported."""
        found = []
        for event in self.events:
            if event["method"] == "Runtime.exceptionThrown":
                details = event["params"]["exceptionDetails"]
                found.append(details.get("exception", {}).get("description") or details["text"])
            elif event["method"] == "Log.entryAdded":
                entry = event["params"]["entry"]
                if (
                    entry.get("source") == "security"
                    or entry.get("level") == "error"
                    and (entry.get("source") == "javascript")
                ):
                    found.append(entry.get("text", ""))
        return found

    def close(self) -> None:
        self.ws.close()


PROFILE_PREFIX = "vllm-mamba-chromium-"


@contextlib.contextmanager
def headless_chromium(width: int = 1000, height: int = 700) -> Iterator[Page]:
    """A headless Chromium with a fresh profile, and its one page (viewport `width`x`height`),
    its Runtime, Log and Page domains enabled.

    Everything the browser writes goes under one directory, `$TMPDIR/vllm-mamba-chromium-
    <pid>-*`: the profile, and its own temporary files (its `TMPDIR`: the singleton socket
    directory `org.chromium.Chromium.*` it leaves when killed). On exit, also on failure,
    the browser's whole process group is killed and waited for until no process of it is
    left, then the directory is removed; anything left raises. Directories left by a run that
    was itself killed (its pid gone) are removed at the next start."""
    binary = browser_path()
    if binary is None:
        raise FileNotFoundError(INSTALL_HINT)
    _remove_orphans()
    root = tempfile.mkdtemp(prefix=f"{PROFILE_PREFIX}{os.getpid()}-")
    profile, tmp = os.path.join(root, "profile"), os.path.join(root, "tmp")
    os.mkdir(tmp)
    cmd = [
        binary,
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where the sandbox cannot start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--hide-scrollbars",
        "--mute-audio",
        f"--window-size={width},{height}",
        f"--user-data-dir={profile}",
        "--remote-debugging-port=0",
        "about:blank",
    ]
    proc = None
    page = None
    try:
        # Its own process group: the browser's child processes (zygotes, renderer, GPU,
        # utility) are killed with it, so none still writes the profile while it is removed.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "TMPDIR": tmp},
        )
        port = _devtools_port(proc, profile)
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        target = next(t for t in targets if t["type"] == "page")
        page = Page(target["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log"):
            page.send(f"{domain}.enable")
        page.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        yield page
    finally:
        try:
            if page is not None:
                page.close()
        finally:
            try:
                if proc is not None:
                    _kill_group(proc)
            finally:
                _remove_tree(root)


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def _kill_group(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Kills the browser's whole process group and waits until no process of it is left.

    Raises:
        RuntimeError: processes of the group are still alive after `timeout` seconds.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        if os.path.isdir("/proc"):
            left = _group_members(proc.pid)
        else:  # no procfs: the group exists while a process (maybe a zombie) is in it
            try:
                os.killpg(proc.pid, 0)
                left = [proc.pid]
            except ProcessLookupError:
                left = []
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"chromium's processes {left} outlived SIGKILL for {timeout} s")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # one forked after the first kill
        time.sleep(0.05)


def _remove_tree(root: str, timeout: float = 10.0) -> None:
    """Removes the browser's directory, retrying while something still writes into it.

    Raises:
        OSError: it could not be removed within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            shutil.rmtree(root)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _remove_orphans() -> None:
    """Removes the directories of earlier runs whose process is gone (killed mid-test)."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith(PROFILE_PREFIX):
            continue
        pid = name[len(PROFILE_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _devtools_port(proc: subprocess.Popen, profile: str) -> int:
    """The DevTools port the browser picked (it writes it to `DevToolsActivePort`)."""
    marker = os.path.join(profile, "DevToolsActivePort")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} on start")
        with contextlib.suppress(OSError, ValueError):
            with open(marker) as f:
                return int(f.readline())
        time.sleep(0.05)
    raise TimeoutError("chromium did not open its DevTools port")
