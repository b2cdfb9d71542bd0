"""Open WebUI itself, unchanged, against ModelForge: a user's chat from headless Chromium.

    python3 -m venv /tmp/owui
    /tmp/owui/bin/pip install open-webui          # 0.12.4 when this was written; a few GB
    .venv/bin/python scripts/open_webui_check.py --open-webui /tmp/owui/bin/open-webui

It starts `modelforge dev` (Temporal, Postgres, the workers; a simulated 24 GiB card whose chat
model is the toy model server, a real HTTP server streaming tokens) and `modelforge gateway` on
loopback, then `open-webui serve` with its Ollama connection pointed at the gateway (no login, offline:
nothing downloads), and drives Debian's headless Chromium over the DevTools protocol: it opens
`/?models=toy-chat:latest&q=...` (Open WebUI's own way to start a chat from a link), waits until the
model's answer is on the page, and saves a screenshot (docs/img/open-webui.png). Then it checks on
ModelForge's side what Open WebUI sent: the model list from /api/tags and the streamed /api/chat,
answered 200, in the gateway's access log.

Not in CI: Open WebUI and its dependencies are several GB, and its first start takes minutes on
the project's 2-core machine. tests/apps replays its requests as its source sends them instead.
Exit 0 when the chat was answered, 1 with what went wrong otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import websockets
from _stack import free_port, gateway_requests, modelforge_stack, started, toy_catalog, wait_http

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "img" / "open-webui.png"
PROMPT = "hello from open webui"
MODEL = "toy-chat"

DISMISS_AND_SEND = """
(() => {
  for (const b of document.querySelectorAll('button')) {
    if (b.innerText.trim().startsWith("Okay, Let's Go")) { b.click(); return 'dismissed'; }
  }
  const box = document.querySelector('#chat-input');
  const send = document.querySelector('#send-message-button');
  if (box && send && !send.disabled && (box.innerText || box.value || '').includes('PROMPT')) {
    send.click(); return 'sent';
  }
  return '';
})()
""".replace("PROMPT", PROMPT)


async def drive_chromium(chromium: str, url: str, profile: Path, seconds: float) -> tuple[str, bytes]:
    """Opens `url` in headless Chromium and waits until the model's answer is in the page's text;
    returns the text and a PNG screenshot."""
    port = free_port()
    argv = [
        chromium,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1280,800",
        f"--remote-debugging-port={port}",
        f"--user-data-dir={profile}",
        "about:blank",
    ]
    browser = subprocess.Popen(  # noqa: S603 (an argument list of our own)
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/json/version", 30, "chromium", browser)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as listing:
            [page] = [t for t in json.load(listing) if t["type"] == "page"]
        async with websockets.connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024) as ws:
            ids = iter(range(1, 1_000_000))

            async def call(method: str, **params: object) -> dict[str, object]:
                sent = next(ids)
                await ws.send(json.dumps({"id": sent, "method": method, "params": params}))
                while True:
                    message = json.loads(await ws.recv())
                    if message.get("id") == sent:
                        if "error" in message:
                            raise SystemExit(f"chromium: {method}: {message['error']}")
                        result: dict[str, object] = message["result"]
                        return result

            await call("Page.enable")
            await call("Page.navigate", url=url)
            deadline = time.monotonic() + seconds
            text = ""
            while time.monotonic() < deadline:
                # What a user does on a first visit: dismiss the release notes, then send the
                # prompt the link put in the box (Open WebUI submits it itself once nothing is
                # in the way; the button is clicked only if the prompt is still in the box).
                await call("Runtime.evaluate", expression=DISMISS_AND_SEND)
                evaluated = await call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''")
                text = str(evaluated["result"]["value"])  # type: ignore[index]
                if f"You said: {PROMPT}" in text:
                    await asyncio.sleep(2)  # the stream's last tokens and the title
                    shot = await call("Page.captureScreenshot", format="png")
                    return text, base64.b64decode(str(shot["data"]))
                await asyncio.sleep(1)
            shot = await call("Page.captureScreenshot", format="png")
            (profile.parent / "open-webui-timeout.png").write_bytes(base64.b64decode(str(shot["data"])))
            raise SystemExit(
                f"no answer on the page in {seconds:.0f} s (screenshot {profile.parent / 'open-webui-timeout.png'}); "
                f"page text: {text[:500]!r}"
            )
    finally:
        browser.kill()
        browser.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--open-webui", default=os.environ.get("OPEN_WEBUI", "open-webui"), help="its executable")
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and data in this directory")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for Open WebUI to answer the chat")
    args = parser.parse_args()
    open_webui = shutil.which(args.open_webui)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not open_webui or not chromium:
        raise SystemExit(f"needs open-webui ({args.open_webui}) and Debian's chromium on PATH")
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="mf-owui-"))
    scratch.mkdir(parents=True, exist_ok=True)
    webui_port = free_port()
    began = time.monotonic()
    with modelforge_stack(toy_catalog(MODEL), scratch) as gateway_port:
        webui_env = {
            **os.environ,
            "DATA_DIR": str(scratch / "open-webui"),
            "OLLAMA_BASE_URL": f"http://127.0.0.1:{gateway_port}",
            "ENABLE_OPENAI_API": "False",
            "WEBUI_AUTH": "False",
            "OFFLINE_MODE": "True",
            "HF_HUB_OFFLINE": "1",
            "ENABLE_VERSION_UPDATE_CHECK": "False",
            "WEBUI_SECRET_KEY": "modelforge-open-webui-check",
            "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",  # its own embedding model would download
        }
        (scratch / "open-webui").mkdir(exist_ok=True)
        with started(
            [open_webui, "serve", "--host", "127.0.0.1", "--port", str(webui_port)],
            webui_env,
            scratch / "open-webui.log",
        ) as webui:
            wait_http(f"http://127.0.0.1:{webui_port}/health", 600, "open-webui", webui)
            print(f"stack, gateway and Open WebUI up in {time.monotonic() - began:.0f} s", flush=True)
            query = urllib.parse.urlencode({"models": f"{MODEL}:latest", "q": PROMPT})
            url = f"http://127.0.0.1:{webui_port}/?{query}"
            text, png = asyncio.run(drive_chromium(chromium, url, scratch / "chromium", args.timeout))
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.write_bytes(png)
    served = [(r.get("method"), r.get("route"), r.get("status")) for r in gateway_requests(scratch)]
    chats = [r for r in served if r[1] == "/api/chat"]
    print(f"answered on the page: {text[text.find('You said') :][:80]!r}")
    print(f"gateway requests from Open WebUI: {len(served)}; /api/chat: {chats}")
    print(f"screenshot: {SCREENSHOT}; logs: {scratch}")
    if not chats or any(status != 200 for _, _, status in chats):
        raise SystemExit("Open WebUI's chat did not reach ModelForge as a 200 /api/chat")


if __name__ == "__main__":
    main()
