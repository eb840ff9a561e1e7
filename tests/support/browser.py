"""Headless Chromium driven over the DevTools protocol: open a page, wait until given texts
are rendered (in `document.body.innerText`, so visible, not merely in the HTML: Phoenix's
pages are a React app that fetches the trace after loading), and keep a screenshot.

Needs Debian's `chromium` (`cargo xtask setup`, as root) and the `websockets` package."""

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

import websockets


@dataclass
class Rendered:
    """What the page showed: the texts still missing at the deadline (none: all shown), the
    page's text then, and how long it took; the value of `evaluate` then (if given), and the
    console's errors and the page's uncaught exceptions."""
    missing: list
    text: str
    seconds: float
    value: object = None
    errors: list = None


class _DevTools:
    def __init__(self, socket):
        self.socket, self.next_id, self.pending = socket, 0, {}
        self.errors = []

    async def read(self):
        async for message in self.socket:
            message = json.loads(message)
            future = self.pending.pop(message.get("id"), None)
            if future is not None:
                future.set_result(message)
            self._note_error(message)

    def _note_error(self, message):
        """Console errors, failed loads and uncaught exceptions, as a person opening the
        console would see them."""
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(f"exception: {params.get('exceptionDetails', {}).get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(f"console.{params['type']}: {[a.get('value') for a in params.get('args', [])]}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    async def call(self, method, params=None, session=None):
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        await self.socket.send(json.dumps(message))
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]


async def _render(url, texts, screenshot, timeout, width, height, evaluate=None):
    profile = tempfile.mkdtemp(prefix="gym-tracer-chromium-")
    browser = subprocess.Popen(
        ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--no-default-browser-check", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")
        started = time.monotonic()
        while not (os.path.exists(port_file) and len(open(port_file).read().split()) >= 2):
            if browser.poll() is not None or time.monotonic() - started > 30:
                raise RuntimeError(f"chromium did not start (exit status {browser.poll()})")
            await asyncio.sleep(0.05)
        port, path = open(port_file).read().split()[:2]
        async with websockets.connect(f"ws://127.0.0.1:{port}{path}", max_size=None) as socket:
            devtools = _DevTools(socket)
            reader = asyncio.create_task(devtools.read())
            target = (await devtools.call("Target.createTarget", {"url": "about:blank"}))["targetId"]
            session = (await devtools.call("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
            await devtools.call("Emulation.setDeviceMetricsOverride",
                                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
            await devtools.call("Page.enable", {}, session)
            await devtools.call("Runtime.enable", {}, session)
            await devtools.call("Log.enable", {}, session)
            opened = time.monotonic()
            await devtools.call("Page.navigate", {"url": url}, session)
            missing, text = list(texts), ""
            while missing and time.monotonic() - opened < timeout:
                await asyncio.sleep(0.2)
                result = await devtools.call("Runtime.evaluate", {
                    "expression": "document.body ? document.body.innerText : ''", "returnByValue": True}, session)
                text = result["result"].get("value") or ""
                missing = [t for t in texts if t not in text]
            seconds = time.monotonic() - opened
            value = None
            if evaluate:
                result = await devtools.call("Runtime.evaluate", {"expression": evaluate, "returnByValue": True},
                                             session)
                value = result["result"].get("value")
            await asyncio.sleep(0.5)  # let the layout settle before the picture
            shot = await devtools.call("Page.captureScreenshot", {"format": "png"}, session)
            with open(screenshot, "wb") as out:
                out.write(base64.b64decode(shot["data"]))
            try:
                await devtools.call("Browser.close")
            except (RuntimeError, asyncio.TimeoutError, websockets.ConnectionClosed):
                pass
            reader.cancel()
            return Rendered(missing, text, seconds, value, list(devtools.errors))
    finally:
        try:
            browser.wait(10)
        except subprocess.TimeoutExpired:
            browser.kill()
            browser.wait()
        shutil.rmtree(profile, ignore_errors=True)


def render(url, texts, screenshot, timeout=60, width=1600, height=1000, evaluate=None):
    """Opens `url`, waits up to `timeout` s until every one of `texts` is shown, saves a PNG
    screenshot to `screenshot` (whatever was shown then) and says what was missing; evaluates
    the JavaScript expression `evaluate` in the page then, if given."""
    return asyncio.run(_render(url, list(texts), str(screenshot), timeout, width, height, evaluate))
