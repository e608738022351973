"""The course website (`python site/build.py --test`, which CI runs before the tests) in a real browser: every lesson
page loads, shows a figure and no error, every internal link resolves, and the home page links every lesson."""
import functools
import os
import threading
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

from conftest import ROOT
from test_jupyterlab import CHROMIUM, CHROMIUM_ARGS, need_browser

SITE = ROOT / "site/_build"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").exists():
        why = "no built site: run `python site/build.py --test` first"
        if os.getenv("CI"): pytest.fail(why)
        pytest.skip(why)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(SITE)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def status(url) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r: return r.status
    except OSError as e: return getattr(e, "code", 0)


def test_every_lesson_page_in_chromium(site_url):
    need_browser()
    from playwright.sync_api import sync_playwright
    lessons = sorted(p.stem for p in (ROOT / "nbs").glob("[0-9]*.ipynb"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        assert page.goto(site_url + "index.html").status == 200
        home_links = {urlparse(urljoin(page.url, h)).path.rsplit("/", 1)[-1]
                      for h in page.eval_on_selector_all(".md-content a[href]", "els => els.map(e => e.getAttribute('href'))")}
        missing = [n for n in lessons if f"{n}.html" not in home_links]
        assert not missing, f"the home page's lesson map does not link {missing}"
        internal = set()
        for name in lessons:
            resp = page.goto(f"{site_url}lessons/{name}.html")
            assert resp.status == 200, name
            content = page.locator(".md-content")
            assert content.locator("img").count() >= 1, f"{name}: no figure on the page"
            text = content.inner_text()
            assert "Traceback (most recent call last)" not in text and "Error" not in page.title(), name
            for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
                url = urldefrag(href).url
                if url.startswith(site_url): internal.add(url)
        browser.close()
    assert not errors, errors[:3]
    broken = sorted(u for u in internal if status(u) != 200)
    assert not broken, f"broken internal links: {broken[:10]}"


def test_api_reference_lists_the_package(site_url):
    modules = sorted(f.stem for f in (ROOT / "distcourse").glob("[a-z]*.py"))
    for m in modules:
        html = urllib.request.urlopen(f"{site_url}api/distcourse.{m}.html", timeout=10).read().decode()
        assert f"distcourse.{m}" in html
    config = urllib.request.urlopen(f"{site_url}api/distcourse.config.html", timeout=10).read().decode()
    assert "max_steps" in config and "optimizer steps" in config  # a docments comment of Config made it to the page
