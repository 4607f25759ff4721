"""The admin page in a real headless Chromium (selenium + Debian's chromedriver), served
by a real ``infergate controlplane`` polling two simulated nodes; the layout test also
sends requests through a real edge while it shoots the overview and nodes pages at 800
and 1400 px (screenshots in tests/output/<test name>/)."""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from pathlib import Path

import requests

import pytest

from controlplane import procs
from controlplane.routing import registry
from controlplane.config import settings_from_dict
from support.stack import edge_settings

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--window-size=1500,700"]
TOKEN = "browser-admin-token-789"

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (test extra)")
if not (Path(CHROMEDRIVER).exists() and (shutil.which("chromium") or shutil.which("chromium-browser"))):
    pytest.skip("chromium / chromium-driver not installed: apt-get install chromium chromium-driver",
                allow_module_level=True)

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


@pytest.fixture
def browser(workdir: Path):
    opts = webdriver.ChromeOptions()
    for f in CHROMIUM_FLAGS:
        opts.add_argument(f)
    profile = tempfile.mkdtemp(prefix="chromium-", dir=workdir)
    opts.add_argument(f"--user-data-dir={profile}")
    service = Service(CHROMEDRIVER, log_output=str(workdir / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def state_text(driver, node: str) -> str:
    """The state badge of the node's row ('' while the row is being replaced)."""
    try:
        return driver.find_element(By.CSS_SELECTOR, f'#node-{node} td[data-field="state"]').text
    except StaleElementReferenceException:
        return ""


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_login_drain_from_the_nodes_page(browser, redis_server, simnodes, controlplane_factory,
                                         output_dir):
    a, b = simnodes(2, names=["sim-a", "sim-b"], time_scale=0.05)
    settings = settings_from_dict({
        "redis": {"url": redis_server.url},
        "controlplane": {"admin_token": TOKEN, "poll_interval_s": 0.25, "poll_timeout_s": 0.5,
                         "leader_ttl_s": 2.0},
        "nodes": [a.node_settings().model_dump(), b.node_settings().model_dump()],
    })
    cp = controlplane_factory(settings)
    r = redis_server.client()

    browser.get(f"{cp.admin_url}/nodes")
    assert "/login" in browser.current_url
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "login").click()
    procs.wait_until(lambda: browser.current_url.endswith("/nodes"), 10, what="nodes page")
    # both nodes polled healthy, shown live
    procs.wait_until(lambda: state_text(browser, "sim-a") == "active"
                     and state_text(browser, "sim-b") == "active", 20,
                     what="both nodes shown active")
    browser.save_screenshot(str(output_dir / "nodes-before-drain.png"))

    def click_drain() -> bool:
        browser.find_element(By.CSS_SELECTOR, '#node-sim-a button.drain').click()
        return True

    procs.wait_until(click_drain, 10, what="Drain button of sim-a")
    procs.wait_until(lambda: "drain started" in browser.page_source, 10, what="drain confirmation")
    assert state_text(browser, "sim-a") in ("draining", "drained")
    assert state_text(browser, "sim-b") == "active"
    assert registry.get_state(r, "sim-a").state in ("draining", "drained")
    ev = registry.recent_events(r, 20, node="sim-a")
    assert any(e["kind"] == "drain" and re.fullmatch(r"admin@127\.0\.0\.1 \(page [0-9a-f]{6}\)", e["actor"]) for e in ev)

    # no traffic: the control plane marks it drained, and the page shows it without reload
    marker = browser.find_element(By.TAG_NAME, "h1")
    procs.wait_until(lambda: state_text(browser, "sim-a") == "drained", 30,
                     what="sim-a shown drained by the live refresh")
    assert marker.is_displayed()  # same document: updated by the page's own refresh
    assert browser.find_elements(By.CSS_SELECTOR, "#node-sim-a button.undrain")
    browser.save_screenshot(str(output_dir / "nodes-after-drain.png"))
    assert (output_dir / "nodes-after-drain.png").stat().st_size > 5000
    logs = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
            and "favicon" not in e["message"]]
    assert logs == [], logs


GEOMETRY_JS = """
const W = document.documentElement.clientWidth;
const box = e => { const r = e.getBoundingClientRect();
  return {text: (e.textContent || '').trim().slice(0, 60), left: r.left, right: r.right,
          top: r.top + window.scrollY, bottom: r.bottom + window.scrollY}; };
const shown = e => e.getClientRects().length > 0;
return {width: W, scroll_width: document.documentElement.scrollWidth,
        buttons: [...document.querySelectorAll('button')].filter(shown).map(box),
        flashes: [...document.querySelectorAll('.flash')].filter(shown).map(box),
        charts: [...document.querySelectorAll('svg.chart')].filter(shown).map(box),
        scrollers: [...document.querySelectorAll('.scroll')].filter(shown).map(
          e => ({id: (e.querySelector('table') || e).id, scroll: e.scrollWidth, client: e.clientWidth}))};
"""


def set_viewport(driver, width: int, height: int = 1300) -> None:
    """Exactly ``width`` CSS px wide (the window size of headless Chromium is not)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    procs.wait_until(lambda: driver.execute_script("return window.innerWidth") == width, 5,
                     what=f"viewport of {width} px")


def check_layout(driver, width: int, page: str) -> dict:
    """Nothing wider than the viewport, every button inside it, no flash over a button."""
    g = driver.execute_script(GEOMETRY_JS)
    assert width - 20 <= g["width"] <= width, g  # the viewport less a vertical scroll bar
    width = g["width"]
    assert g["scroll_width"] <= width, f"{page} at {width} px scrolls sideways: {g['scroll_width']}"
    assert g["buttons"], page
    for b in g["buttons"]:
        assert b["left"] >= 0 and b["right"] <= width, f"{page} at {width} px: button {b} off-screen"
    for f in g["flashes"]:
        assert f["right"] <= width, f"{page} at {width} px: flash {f} clipped"
        for b in g["buttons"]:
            overlap = (f["left"] < b["right"] and b["left"] < f["right"]
                       and f["top"] < b["bottom"] and b["top"] < f["bottom"])
            assert not overlap, f"{page} at {width} px: flash {f} covers button {b}"
    for c in g["charts"]:
        assert c["right"] <= width, f"{page} at {width} px: chart {c} clipped"
    for sc in g["scrollers"]:  # tables fit without their sideways scroll bar
        assert sc["scroll"] <= sc["client"], f"{page} at {width} px: table {sc} cut off"
    return g


class Load:
    """Chat requests through the edge from a thread (a few per second, one in three
    repeated so the exact cache answers it) until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop_event = threading.Event()
        self.statuses: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with requests.Session() as s:
            i = 0
            while not self.stop_event.is_set():
                body = {"model": "sim-llama", "temperature": 0,
                        "messages": [{"role": "user", "content": f"question {i}" if i % 3
                                      else f"repeated question {i % 4}"}]}
                try:
                    self.statuses.append(s.post(f"{self.url}/v1/chat/completions", json=body,
                                                timeout=10).status_code)
                except requests.RequestException:
                    self.statuses.append(0)
                i += 1
                self.stop_event.wait(0.12)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(15)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_overview_and_nodes_fit_800_and_1400_px_under_load(
        browser, redis_server, simnodes, controlplane_factory, edge_factory, output_dir):
    a, b = simnodes(2, names=["sim-a", "sim-b"], time_scale=0.05)
    nodes = [a.node_settings().model_dump(), b.node_settings().model_dump()]
    settings = settings_from_dict({
        "redis": {"url": redis_server.url},
        "controlplane": {"admin_token": TOKEN, "poll_interval_s": 0.25, "poll_timeout_s": 0.5,
                         "leader_ttl_s": 2.0},
        "nodes": nodes,
    })
    cp = controlplane_factory(settings)
    es = edge_settings(redis_server.url, nodes)
    es.cache = es.cache.model_validate({"enabled": True, "semantic": False})
    edge = edge_factory(es)
    load = Load(edge.url)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        set_viewport(browser, 1400)
        browser.get(f"{cp.admin_url}/")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "login").click()
        procs.wait_until(lambda: browser.current_url.rstrip("/") == cp.admin_url, 10,
                         what="the overview after login")

        seen: dict = {}

        def traffic() -> bool:
            seen.update(requests.get(f"{cp.admin_url}/api/v1/overview", headers=auth,
                                     timeout=5).json())
            t = seen["totals"]
            return seen["points"] >= 3 and t["requests"] > 10 and t["hits_exact"] > 0
        try:
            procs.wait_until(traffic, 60, what="three overview points with traffic and cache hits")
        except procs.StartError as exc:
            raise AssertionError(f"{exc}: {seen.get('points')} points, totals "
                                 f"{seen.get('totals')}, statuses {load.statuses[-10:]}") from None
        for width in (1400, 800):
            set_viewport(browser, width)
            browser.get(f"{cp.admin_url}/")
            procs.wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#t-rps .big"), 10,
                             what="overview tiles")
            rps = browser.find_element(By.CSS_SELECTOR, "#t-rps .big").text
            assert rps.endswith("/s") and rps != "0/s", rps
            assert "%" in browser.find_element(By.CSS_SELECTOR, "#t-hit .big").text
            assert browser.find_elements(By.CSS_SELECTOR, "#ov-node-sim-a .spark polyline")
            g = check_layout(browser, width, "overview")
            assert len(g["charts"]) == 4
            browser.save_screenshot(str(output_dir / f"overview-{width}.png"))
        # the panel refreshes itself (every 5 s) without a reload
        meta = browser.find_element(By.ID, "ov-meta").text
        marker = browser.find_element(By.TAG_NAME, "h1")
        procs.wait_until(lambda: browser.find_element(By.ID, "ov-meta").text != meta, 15,
                         what="the overview's live refresh")
        assert marker.is_displayed() and "live, updated" in browser.find_element(By.ID, "live").text
        check_layout(browser, 800, "overview after a refresh")

        set_viewport(browser, 1400)
        browser.get(f"{cp.admin_url}/nodes")
        procs.wait_until(lambda: state_text(browser, "sim-a") == "active"
                         and state_text(browser, "sim-b") == "active", 20, what="nodes active")
        browser.find_element(By.CSS_SELECTOR, "#node-sim-a button.drain").click()
        procs.wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, ".flash.ok"), 10,
                         what="drain flash")
        procs.wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#node-sim-a button.undrain"),
                         10, what="Undrain button")
        for width in (1400, 800):
            set_viewport(browser, width)
            g = check_layout(browser, width, "nodes")
            assert any(x["text"] == "Undrain" for x in g["buttons"]), g["buttons"]
            assert g["flashes"], "the drain message is shown"
            browser.save_screenshot(str(output_dir / f"nodes-{width}.png"))
        # the button works at 800 px
        browser.find_element(By.CSS_SELECTOR, "#node-sim-a button.undrain").click()
        procs.wait_until(lambda: registry.get_state(redis_server.client(), "sim-a").state == "active",
                         10, what="sim-a undrained from the 800 px page")
        # create a key at 800 px: shown once after the redirect, a reload adds no key
        browser.get(f"{cp.admin_url}/keys")
        browser.find_element(By.CSS_SELECTOR, '#create-key input[name="tenant"]').send_keys("acme-research")
        browser.find_element(By.CSS_SELECTOR, '#create-key input[name="label"]').send_keys(
            "demo key created by infergate up for the quick start")
        browser.find_element(By.CSS_SELECTOR, '#create-key input[name="rpm"]').send_keys("600")
        browser.find_element(By.CSS_SELECTOR, '#create-key input[name="tpm"]').send_keys("100000")
        browser.find_element(By.CSS_SELECTOR, "#create-key button").click()
        procs.wait_until(lambda: browser.find_elements(By.ID, "new-key"), 10, what="the new key")
        assert browser.current_url.endswith("/keys")
        assert browser.find_element(By.ID, "new-key").text.startswith("ig-")
        check_layout(browser, 800, "keys")
        browser.save_screenshot(str(output_dir / "keys-800.png"))
        browser.refresh()
        procs.wait_until(lambda: browser.find_elements(By.ID, "keys"), 10, what="keys page")
        assert not browser.find_elements(By.ID, "new-key")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#keys tbody tr[id^=key-]")) == 1
        for page in ("cache", "events", "nodes/sim-b"):
            browser.get(f"{cp.admin_url}/{page}")
            check_layout(browser, 800, page)
            browser.save_screenshot(str(output_dir / f"{page.replace('/', '-')}-800.png"))
    finally:
        load.stop()
    assert load.statuses.count(200) > 10, load.statuses[-20:]
    for name in ("overview-800", "overview-1400", "nodes-800", "nodes-1400"):
        assert (output_dir / f"{name}.png").stat().st_size > 10000, name
    logs = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
            and "favicon" not in e["message"]]
    assert logs == [], logs
