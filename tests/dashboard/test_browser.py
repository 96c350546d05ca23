"""End to end in a real browser: `streamlit run app.py` on a free port, headless Chromium driven by
Selenium through the system chromedriver. Loads every page, runs a small plan by pressing the
button, and saves a screenshot of each page: to a temporary folder, or to the folder named by
SERVEPLAN_SCREENSHOTS_DIR (`SERVEPLAN_SCREENSHOTS_DIR=docs/screenshots pytest tests/dashboard/test_browser.py`
refreshes the README's images), so that running the suite never rewrites tracked files.

Waits on page elements, never on fixed sleeps: Streamlit draws over a websocket after the HTML
loads, so a plain `chromium --screenshot` captures it half-drawn.
"""

from __future__ import annotations

from collections.abc import Iterator
import json
import os
from pathlib import Path
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# CI (.ci/run) installs both and sets SERVEPLAN_REQUIRE_BROWSER=1: there a missing browser fails.
pytestmark = pytest.mark.skipif(
    (shutil.which("chromium") is None or shutil.which("chromedriver") is None)
    and os.environ.get("SERVEPLAN_REQUIRE_BROWSER") != "1",
    reason="the browser test needs chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra: pip install -e '.[dev]'")
from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402 (after the skip checks)
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = "requests=60&rate=4"
# page url path (after /) and query -> text that shows its results are drawn
PAGES = [
    ("simulate", SMALL, "Latency percentiles"),
    ("compare", SMALL, "Variants side by side"),
    ("memory", "model=llama-3.1-70b&tp=4&weight_dtype=fp8&kv_dtype=fp8", "Max concurrency by context"),
    ("hardware", "", "Roofline points"),
    ("validate", "", "Validate"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    # A private planner cache, so the plan below is computed rather than read from the user's.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}
    # The server's output goes to a file, never to a pipe left unread: once a pipe's 64 KiB filled,
    # the server would block on its next log line and every page after it would hang undrawn.
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.headless", "true",
             "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"streamlit did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.2)  # polling the health endpoint, not waiting for the page
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:  # a browser session still open can hold Streamlit's shutdown up
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", f"--window-size={WINDOW[0]},{WINDOW[1]}", "--hide-scrollbars"):
        options.add_argument(flag)
    # The system driver: Selenium Manager would otherwise try to download one.
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")),
                              options=options)
    yield driver
    driver.quit()


# Waits end when the page is drawn; the limits only turn a hang into a failure, and are generous
# because CI runs this beside the rest of the suite on two busy cores.
PAGE_TIMEOUT_S = 600


def _wait_drawn(driver: webdriver.Chrome, text: str, timeout: float = PAGE_TIMEOUT_S) -> None:
    """Until `text` is on the page, Streamlit has stopped running and every chart has drawn."""
    wait = WebDriverWait(driver, timeout)
    wait.until(ec.presence_of_element_located((By.XPATH, f"//*[contains(normalize-space(.), {text!r})]")))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]'))
    wait.until(lambda d: all(c.find_elements(By.CSS_SELECTOR, "canvas, svg")
                             for c in d.find_elements(By.CSS_SELECTOR, '[data-testid="stVegaLiteChart"]')))
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("SERVEPLAN_SCREENSHOTS_DIR") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


WINDOW = (1440, 1800)
# Pages whose README image shows the whole page (up to this height), not the first screen: the
# Simulate page's over-time and operator charts lie below its first screen.
WHOLE_PAGE = {"simulate": 3400}


def _screenshot(driver: webdriver.Chrome, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    if name in WHOLE_PAGE:
        height = driver.execute_script('return document.querySelector(\'[data-testid="stMain"]\').scrollHeight')
        driver.set_window_size(WINDOW[0], min(int(height) + 60, WHOLE_PAGE[name]))
        _wait_drawn(driver, name.capitalize())  # the page title; charts redraw at the new size
    try:
        assert driver.save_screenshot(str(path))
    finally:
        driver.set_window_size(*WINDOW)
    return path


# Every chart as drawn (Streamlit draws Vega charts as SVG): its title, every text in it, its
# plot height (the tallest run of grid lines) and each legend label a person cannot read whole:
# outside the chart's box (Streamlit cuts a chart at its declared height) or shortened with "…".
_CHARTS_JS = """
return [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')].map(chart => {
  const box = chart.getBoundingClientRect();
  const inside = r => r.top >= box.top - 1 && r.bottom <= box.bottom + 1 && r.left >= box.left - 1 && r.right <= box.right + 1;
  return {
    title: [...chart.querySelectorAll('.role-title-text')].map(t => t.textContent).join(' '),
    texts: [...chart.querySelectorAll('text')].map(t => t.textContent),
    legend: [...chart.querySelectorAll('.role-legend-label text')].map(t => t.textContent),
    cut: [...chart.querySelectorAll('.role-legend-label text')]
      .filter(t => !inside(t.getBoundingClientRect()) || t.textContent.endsWith('…')).map(t => t.textContent),
    plot_px: Math.max(0, ...[...chart.querySelectorAll('.role-axis-grid')].map(g => g.getBoundingClientRect().height)),
  };
});
"""
OVER_TIME = ("queue depth (requests)", "batch size (requests)", "KV cache used (share)")
MIN_PLOT_PX = 120


def _assert_readable(driver: webdriver.Chrome) -> list[dict]:
    """What a person sees: no NaN in the page or its charts, every legend label whole and inside
    its chart, no true/false legend, no select left reading Streamlit's "Choose an option" (an
    unset engine knob reads "engine default"); returns the charts for page-specific checks."""
    charts = driver.execute_script(_CHARTS_JS)
    assert "NaN" not in driver.find_element(By.TAG_NAME, "body").text
    empty = [e.get_attribute("aria-label") for e in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stSelectbox"] input')
             if not e.get_attribute("value") and e.get_attribute("placeholder") == "Choose an option"]
    assert not empty, empty
    assert not [(c["title"], t) for c in charts for t in c["texts"] if "NaN" in t]
    assert not [(c["title"], c["cut"]) for c in charts if c["cut"]]
    assert not [c["title"] for c in charts if {"true", "false"} & set(c["legend"])]
    return charts


PLAN_QUESTION = {"hw": "h100-sxm,l40s", "max_gpus": "2", "weight_dtypes": "bf16,fp8", "kv_dtypes": "bf16",
                 "requests": "40"}


def _cli_plan(tmp_path: Path) -> dict:
    """`serveplan plan` on the Plan page's question: its defaults (model, workload, rate, SLO) and PLAN_QUESTION."""
    from dashboard.inputs import DEFAULT_MODEL, DEFAULT_RATE_PER_S, DEFAULT_SLO

    q = PLAN_QUESTION
    out = subprocess.run(
        [sys.executable, "-m", "planner.cli", "plan", "--model", DEFAULT_MODEL, "--workload", "chat",
         "--rate", f"{DEFAULT_RATE_PER_S:g}", "--slo", DEFAULT_SLO, "--hw", q["hw"], "--max-gpus", q["max_gpus"],
         "--weight-dtypes", q["weight_dtypes"], "--kv-dtypes", q["kv_dtypes"], "--requests-per-probe", q["requests"],
         "--executor", "serial", "--cache-dir", str(tmp_path / "cli-cache"), "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout)


def _click(driver: webdriver.Chrome, locator: tuple[str, str]) -> None:
    """Clicks the element once nothing covers it. The sidebar form is taller than the window, so the
    element is brought to the middle first; and Streamlit may still be laying the sidebar out when the
    element first shows (a widget above it grows and another lands where it was), so a click that
    lands on something else is tried again, on the element as it now stands."""
    def clicked(d: webdriver.Chrome) -> bool:
        element = d.find_element(*locator)
        d.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
        try:
            element.click()
        except (ElementClickInterceptedException, StaleElementReferenceException):
            return False
        return True

    WebDriverWait(driver, PAGE_TIMEOUT_S).until(clicked)


def test_plan_in_the_browser(server: str, browser: webdriver.Chrome, screenshots: Path, tmp_path: Path) -> None:
    browser.get(f"{server}/?" + "&".join(f"{k}={v}" for k, v in PLAN_QUESTION.items()))
    _click(browser, (By.XPATH, "//button[.//*[contains(text(), 'Run plan')]]"))
    _wait_drawn(browser, "Recommended:")
    assert "Why not: rejected candidates" in browser.page_source
    _assert_readable(browser)
    # The same question asked of the CLI gets the same answer.
    rec = _cli_plan(tmp_path)["recommended"]
    shown = browser.find_element(By.XPATH, "//h3[starts-with(normalize-space(.), 'Recommended:')]").text
    assert shown.startswith(f"Recommended: {rec['replicas']} × {rec['label']}"), (shown, rec["label"])
    assert f"{rec['usd_per_hour']:,.2f}" in browser.find_element(By.TAG_NAME, "body").text
    assert _screenshot(browser, screenshots, "plan").stat().st_size > 20_000


@pytest.mark.parametrize(("page", "query", "marker"), PAGES, ids=[p[0] for p in PAGES])
def test_page_in_the_browser(server: str, browser: webdriver.Chrome, screenshots: Path, page: str, query: str,
                             marker: str) -> None:
    browser.get(f"{server}/{page}?{query}")
    _wait_drawn(browser, marker)
    if page == "memory":  # Vega draws a chart's legend after its SVG element appears: wait for the bar's
        WebDriverWait(browser, PAGE_TIMEOUT_S).until(
            lambda d: any("KV cache" in c["legend"] for c in d.execute_script(_CHARTS_JS)))
    charts = _assert_readable(browser)
    if page == "simulate":
        over_time = [c for c in charts if c["title"] in OVER_TIME]
        assert len(over_time) == len(OVER_TIME) and all(c["plot_px"] >= MIN_PLOT_PX for c in over_time), over_time
    if page == "memory":  # every part of the bar is named in its legend, the KV cache and the reserves included
        [bar] = [c for c in charts if "KV cache" in c["legend"]]
        assert {"left by the engine (context, graphs, ...)", "kept by the driver (marketed - reported)"} <= set(bar["legend"])
    assert _screenshot(browser, screenshots, page).stat().st_size > 20_000
