"""The HTML viewer in a real headless browser (Debian's chromium driven by Playwright).

It must load with no console errors and no network requests, react to hovering a token and to
switching heads, open a model-view thumbnail, render 512 tokens promptly, and show hostile text
as text. Screenshots are written to the system's temporary folder (qkv-viewer-*.png).

Set-up (Debian/Ubuntu): apt-get update && apt-get install -y chromium
(Playwright's own browser download is not used.)
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import qkv
from qkv import viz

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        "needs Debian's chromium at /usr/bin/chromium: apt-get update && apt-get install -y "
        "chromium",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="needs playwright: pip install playwright"
)

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = Path(tempfile.gettempdir())
HOSTILE = [
    "<script>window.__pwned = 1</script>",
    '"><img src=x onerror="window.__pwned = 2">',
    "<img src=http://example.invalid/track.png>",
    "</script><b>bold</b>",
]
TOKENS = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]


def traced(tokens: list[str], *, layers: int = 2, heads: int = 4, causal: bool = False) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[qkv.SelfAttention(8 * heads, heads, causal=causal) for _ in range(layers)]
    )
    with torch.no_grad(), qkv.trace(model) as t:
        model(torch.randn(1, len(tokens), 8 * heads) * 3)
    t.tokens = tokens
    return t


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield launched
        launched.close()


class Page:
    """A page with every console message, page error, dialog and request recorded."""

    def __init__(self, browser: Any, path: Path, width: int = 1280) -> None:
        self.page = browser.new_page(viewport={"width": width, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page.on(
            "console",
            lambda m: self.errors.append(m.text) if m.type in ("error", "warning") else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.route("**/*", self._route)
        self.url = path.resolve().as_uri()
        start = time.perf_counter()
        self.page.goto(self.url)
        # A selector, not wait_for_function: polling a JS string needs eval, which the page's
        # Content-Security-Policy (rightly) forbids whenever the first check is not yet true.
        self.page.wait_for_selector("html[data-ready]", state="attached", timeout=30_000)
        self.load_seconds = time.perf_counter() - start
        assert self.page.evaluate("document.documentElement.dataset.ready") == "true"

    def _route(self, route: Any) -> None:
        if route.request.url == self.url:
            route.continue_()
        else:
            route.abort()

    def eval(self, script: str) -> Any:
        return self.page.evaluate(script)

    def canvas(self, element_id: str) -> str:
        return self.eval(f"document.getElementById('{element_id}').toDataURL()")

    def highlighted(self) -> list[str]:
        return self.eval(
            "[...document.querySelectorAll('#tokens-k .tok')].map(e => e.style.backgroundColor)"
        )

    def close(self) -> None:
        self.page.close()


@pytest.fixture(scope="module")
def small_page(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    path = tmp_path_factory.mktemp("viewer") / "small.html"
    viz.view(traced(TOKENS, causal=True), title="The cat sat on the mat.").save(path)
    page = Page(browser, path)
    yield page
    page.close()


def test_loads_without_errors_or_network(small_page: Page) -> None:
    page = small_page
    assert page.errors == []
    assert page.requests == [page.url]  # the file itself, nothing else
    assert page.eval("document.querySelectorAll('#tokens-q .tok').length") == len(TOKENS)
    assert page.eval("document.getElementById('layer').options.length") == 2
    assert page.eval("document.getElementById('head').options.length") == 4
    page.page.screenshot(path=str(SHOTS / "qkv-viewer-small.png"))


def test_hovering_a_token_changes_the_highlight(small_page: Page) -> None:
    page = small_page
    page.page.mouse.move(5, 5)
    before_lines, before_tokens = page.canvas("lines"), page.highlighted()
    page.page.locator("#tokens-q .tok").nth(3).hover()  # "sat" as a query
    after_lines, after_tokens = page.canvas("lines"), page.highlighted()
    assert after_lines != before_lines
    assert after_tokens != before_tokens
    assert sum(1 for color in after_tokens if color) >= 1  # keys it attends are shaded
    assert page.eval("document.querySelector('#tokens-q .tok.focus').textContent") == "sat"
    info = page.eval("document.getElementById('focus-info').textContent")
    assert info.startswith("\u201csat\u201d (query 3) attends most to")
    page.page.screenshot(path=str(SHOTS / "qkv-viewer-hover.png"))
    page.page.locator("#tokens-k .tok").nth(2).hover()  # "cat" as a key: who looks at it
    assert page.eval("document.querySelector('#tokens-k .tok.focus').textContent") == "cat"
    assert page.canvas("lines") != after_lines


def test_switching_head_and_layer_changes_the_drawing(small_page: Page) -> None:
    page = small_page
    matrix = page.canvas("matrix")
    page.page.select_option("#head", "2")
    assert page.eval("window.qkvViewer.state.head") == 2
    switched = page.canvas("matrix")
    assert switched != matrix
    page.page.select_option("#layer", "1")
    assert page.canvas("matrix") != switched
    assert page.eval("document.getElementById('head-title').textContent") == "layer 1, head 2"


def test_model_view_thumbnail_opens_a_head(small_page: Page) -> None:
    page = small_page
    page.page.click("button[data-view=model]")
    thumbnails = page.page.locator("#model-grid canvas")
    assert thumbnails.count() == 2 * 4
    page.page.screenshot(path=str(SHOTS / "qkv-viewer-model.png"))
    thumbnails.nth(4 + 1).click()  # layer 1, head 1
    assert page.eval("window.qkvViewer.state.view") == "head"
    assert (
        page.eval("window.qkvViewer.state.layer"),
        page.eval("window.qkvViewer.state.head"),
    ) == (
        1,
        1,
    )
    assert page.page.is_visible("#head-view") and not page.page.is_visible("#model-view")
    assert page.errors == []


def test_hostile_text_is_shown_as_text(browser: Any, tmp_path: Path) -> None:
    path = viz.view(traced([*HOSTILE, "ok"], layers=1), title=HOSTILE[0]).save(tmp_path / "x.html")
    page = Page(browser, path)
    shown = page.eval("[...document.querySelectorAll('#tokens-q .tok')].map(e => e.textContent)")
    assert shown == [*HOSTILE, "ok"]
    assert page.eval("document.getElementById('title').textContent") == HOSTILE[0]
    assert page.eval("window.__pwned") is None
    assert page.eval("document.querySelectorAll('main img, main b, header b').length") == 0
    page.page.locator("#tokens-q .tok").nth(1).hover()
    assert page.dialogs == [] and page.errors == []
    assert page.requests == [page.url]
    page.page.screenshot(path=str(SHOTS / "qkv-viewer-hostile.png"))
    page.close()


def test_512_tokens_render_promptly(browser: Any, tmp_path: Path) -> None:
    words = ["the", "cat", "sat", "on", "mat", "and", "looked", "around", "."]
    tokens = [words[i % len(words)] for i in range(512)]
    path = viz.view(traced(tokens, layers=6, heads=12), title="512 tokens").save(
        tmp_path / "l.html"
    )
    page = Page(browser, path)
    assert page.load_seconds < 10  # "within a few seconds" on a busy 2-core machine
    assert page.eval("window.qkvViewer.lastRenderMs") < 2000
    start = time.perf_counter()
    page.page.select_option("#head", "7")
    page.page.locator("#tokens-q .tok").nth(40).hover()
    assert time.perf_counter() - start < 5
    page.page.screenshot(path=str(SHOTS / "qkv-viewer-512.png"))
    page.page.click("button[data-view=model]")
    assert page.page.locator("#model-grid canvas").count() == 6 * 12
    page.page.screenshot(path=str(SHOTS / "qkv-viewer-512-model.png"))
    assert page.errors == [] and page.requests == [page.url]
    page.close()
