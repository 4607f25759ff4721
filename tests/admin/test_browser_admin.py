"""The admin page in a real headless Chromium (selenium + Debian's chromedriver), served
by a real ``infergate controlplane`` polling two simulated nodes."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from controlplane import procs
from controlplane.routing import registry
from controlplane.config import settings_from_dict

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
    assert any(e["kind"] == "drain" and e["actor"] == "admin" for e in ev)

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
