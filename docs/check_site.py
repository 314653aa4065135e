"""Open the built site in headless Chromium, served over http://127.0.0.1 (the site's search needs http): the home
page, the ESConfig reference and the logged-metrics page render without a console error or a request leaving this
machine, and a search for a field name finds its entry. Screenshots go to SHOTS.

    python docs/check_site.py [SITE=build/docs] [SHOTS=build/docs-check]   # `make docs-check`

Chromium is Debian's (`apt-get install chromium`), or the browser $CHROMIUM names; Playwright drives it.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse


PAGES = {"index": "index.html", "esconfig": "reference/config.html", "logged_metrics": "logged_metrics.html"}
"""The pages opened (screenshot name → path in the site)."""
FIELD = "lowrank_members_per_call"
"""The field searched for: its ESConfig entry must be among the first result's sections."""
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def find_chromium() -> str | None:
    """$CHROMIUM, or the first Chromium or Chrome on the PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return next(filter(None, map(shutil.which, names)), None)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    """A server of `site` on a free port of 127.0.0.1, in a background thread."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def check_site(site: Path, shots: Path, chromium: str) -> list[str]:
    """The problems found (none: the site passed); the screenshots' paths are printed."""
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    server = serve(site)
    root = f"http://127.0.0.1:{server.server_address[1]}/"
    problems: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            where = {"page": ""}
            page.on("console", lambda m: m.type == "error" and problems.append(f"{where['page']}: console: {m.text}"))
            page.on("pageerror", lambda error: problems.append(f"{where['page']}: {error}"))
            page.on("requestfailed", lambda r: problems.append(f"{where['page']}: failed request {r.url}"))

            def local_only(route):
                if urlparse(route.request.url).hostname == "127.0.0.1":
                    return route.continue_()
                problems.append(f"{where['page']}: request leaving this machine: {route.request.url}")
                return route.abort()

            page.route("**/*", local_only)
            for name, path in PAGES.items():
                where["page"] = path
                page.goto(root + path, wait_until="networkidle")
                if not page.locator("article h1").first.is_visible():
                    problems.append(f"{path}: no title rendered")
                save(page, shots / f"{name}.png")
            where["page"] = f"search for {FIELD}"
            page.goto(root + "index.html", wait_until="networkidle")
            search = page.locator("input.md-search__input")
            search.click()
            search.press_sequentially(FIELD)  # keystrokes, as a reader types
            first = page.locator(".md-search-result__item").first
            try:
                first.wait_for(timeout=15_000)
            except Exception:
                problems.append(f"the search for {FIELD} found nothing")
            else:
                links = [urlparse(a.get_attribute("href") or "") for a in first.locator("a").all()]
                if not any(
                    u.path.endswith("reference/config.html") and u.fragment == f"ESConfig.{FIELD}" for u in links
                ):
                    problems.append(f"the first result for {FIELD} is not its ESConfig entry: {links}")
            save(page, shots / "search.png")
            browser.close()
    finally:
        server.shutdown()
    return problems


def save(page, path: Path) -> None:
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "build/docs")
    shots = Path(argv[1] if len(argv) > 1 else "build/docs-check")
    chromium = find_chromium()
    if chromium is None:
        print("check_site: no Chromium found: apt-get install chromium, or set CHROMIUM", file=sys.stderr)
        return 1
    problems = check_site(site, shots, chromium)
    for problem in problems:
        print(f"check_site: {problem}", file=sys.stderr)
    print(f"check_site: {len(PAGES)} pages and a search in {chromium}: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
