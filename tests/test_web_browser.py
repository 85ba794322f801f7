"""The web page (docs/web.md) in a real browser: Debian's chromium and
chromium-driver, driven headless by selenium (`.ci/run` installs them; these
tests skip, saying why, where they are absent).

The default tier keeps to the gateway and a fake compute (tests/test_gateway.py),
whose output the test chooses: the page loads clean, a reply streams, the stop
button cancels on compute, hostile output stays text. The slow tier runs a
real `moe-pipe up` on the tiny model: charts, heatmap, restart, api_key, and
the screenshots of docs/web.md (written to $MOE_PIPE_WEB_SCREENSHOTS, e.g. docs,
when it is set)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from . import test_gateway

# the gateway with fake computes of tests/test_gateway.py, and what it needs
start_gateway, model_path, tokenizer = test_gateway.start_gateway, test_gateway.model_path, test_gateway.tokenizer

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test extra: pip install '.[test]'")
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

pytestmark = pytest.mark.integration
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
HOSTILE = ["<img src=x onerror=alert(1)>", " <script>window.pwned = 1</script>", " <b>bold</b> &amp; done"]


@pytest.fixture
def browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver; .ci/run does)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_script_timeout(10)
    yield driver
    driver.quit()


def wait(predicate, timeout_s: float = 20, what: str = "the page"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, url: str, live: bool = True) -> None:
    driver.get(url + "/")
    if live:
        wait(lambda: driver.find_element(By.ID, "conn").text == "live", what="the event stream")


def say(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def answers(driver) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#messages .turn.assistant .answer")]


def idle(driver) -> bool:
    return driver.find_element(By.ID, "send").is_enabled()


# ------------------------------------------------------------------ default tier: a fake compute


def test_the_page_loads_clean_and_model_output_is_only_text(start_gateway, browser):
    svc = start_gateway()
    svc.start_computes({"script": [HOSTILE]})
    svc.wait_ready()
    open_page(browser, svc.url)
    say(browser, "show me some html")
    wait(lambda: idle(browser) and answers(browser) == ["".join(HOSTILE)], what="the whole reply")
    messages = browser.find_element(By.ID, "messages")
    assert messages.find_elements(By.CSS_SELECTOR, "img, script, b") == []  # text nodes, not elements
    assert browser.execute_script("return window.pwned === undefined")
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018 - raises when no alert ran
    assert console_errors(browser) == []
    # the conversation is kept in the page: the second turn sends the first one back
    say(browser, "again")
    wait(lambda: idle(browser) and len(answers(browser)) == 2, what="the second reply")
    generates = svc.computes[0].events("generate")
    assert len(generates) == 2 and generates[1]["n_prompt"] > generates[0]["n_prompt"]
    assert console_errors(browser) == []


def test_a_reply_streams_and_stop_cancels_it_on_compute(start_gateway, browser):
    svc = start_gateway()
    fc = svc.start_computes({"delay_s": 0.1})
    svc.wait_ready()
    open_page(browser, svc.url)
    say(browser, "count")
    seen = wait(lambda: answers(browser) and "w3 " in answers(browser)[0] and answers(browser)[0], what="text while it generates")
    assert not idle(browser) and "w60 " not in seen  # streamed: part of the reply is shown before the rest exists
    browser.find_element(By.ID, "stop").click()
    wait(lambda: browser.find_element(By.CSS_SELECTOR, ".turn.assistant .note").text == "stopped", what="the stop")
    cancels = wait(lambda: fc.events("cancel"), what="compute's Cancel")
    assert cancels[0]["req_id"] == fc.events("generate")[0]["req_id"]
    assert idle(browser) and console_errors(browser) == []


def test_the_live_view_shows_each_slot_as_telemetry_tells_it(start_gateway, browser):
    import zmq

    from moe_pipe.shared.progress import slot_text
    from moe_pipe.shared.wire import ipc
    from moe_pipe.shared.wire import messages as m

    svc = start_gateway()
    svc.start_computes({})
    svc.wait_ready()
    ctx = zmq.Context()
    pub = ipc.bind(ctx, ipc.Endpoints(svc.rt.path), "telemetry_pub")  # telemetry, played by this test
    try:
        open_page(browser, svc.url)
        browser.find_element(By.CSS_SELECTOR, 'nav button[data-view="live"]').click()
        assert not browser.find_element(By.ID, "slots-box").is_displayed()  # one slot, or none heard of: no list
        states = m.SlotStates((7, 9, 0), (40, 3664, 0), (0, 512, 0), (40, 1536, 0), (35, 0, 0), (75, 1536, 0), 14336)

        def items(what: str) -> list[str]:
            # read in one script: each SlotStates redraws the list, and elements found before a
            # redraw are stale by the time their text is asked for
            return browser.execute_script(f"return [...document.querySelectorAll('#slots li')].map(li => {what});")

        def shown() -> list[str]:
            ipc.send(pub, states)  # until the gateway's subscription has reached us
            return items("li.textContent")

        want = [slot_text(r) for r in states.rows()]
        assert wait(lambda: shown() == want and shown(), what="the slots") == want
        assert browser.find_element(By.ID, "slots-box").is_displayed()
        assert items("li.dataset.state") == [
            "decoding",
            "prompt",
            "idle",
        ]
        assert browser.find_element(By.ID, "kv-pool").text == "KV pool 1,611 / 14,336 positions"
        assert console_errors(browser) == []
    finally:
        pub.close(0)
        ctx.term()


# ------------------------------------------------------------------ slow tier


@pytest.mark.slow
def test_with_an_api_key_the_page_refuses_until_the_key_is_given(start_gateway, browser):
    svc = start_gateway({"gateway.api_key": "k3y"})
    svc.start_computes({"script": [["hello", " there"]]})
    svc.wait_ready()
    open_page(browser, svc.url, live=False)
    wait(lambda: browser.find_element(By.ID, "keybox").is_displayed(), what="the key prompt")
    assert browser.find_element(By.ID, "conn").text == "key needed"
    say(browser, "hi")
    wait(lambda: idle(browser), what="the refusal")
    assert answers(browser) == [] and svc.computes[0].events("generate") == []
    browser.find_element(By.ID, "key").send_keys("k3y")
    browser.find_element(By.ID, "keysave").click()
    wait(lambda: browser.find_element(By.ID, "conn").text == "live", what="the event stream with the key")
    assert browser.execute_script("return sessionStorage.getItem('moe-pipe-api-key')") == "k3y"
    assert browser.execute_script("return localStorage.length") == 0 and browser.get_cookies() == []
    browser.find_element(By.ID, "send").click()  # the refused message went back into the box
    wait(lambda: idle(browser) and answers(browser) == ["hello there"], what="the reply with the key")


def tab(driver, name: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f"nav button[data-view='{name}']").click()


def shoot(driver, folder: Path, name: str) -> None:
    time.sleep(0.3)  # the next animation frame has drawn
    driver.save_screenshot(str(folder / f"web-{name}.png"))


@pytest.mark.slow
def test_live_view_of_a_real_service(browser, tmp_path):
    """`moe-pipe up` on the tiny model: the charts gain one point per token,
    the heatmap shows the residency index's count and, while compute works,
    pinned or in-flight experts, and once idle the counts of the reader's
    shared states; kill -9 of compute shows in the process panel and the page
    carries on without a reload."""
    from moe_pipe.shared.experts.residency import INFLIGHT, PINNED, ResidencyIndex
    from moe_pipe.shared.experts.shm import segment_name
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.makemodel.default_model import default_model_path

    from .test_service import Service, chat

    shots = Path(os.environ.get("MOE_PIPE_WEB_SCREENSHOTS") or tmp_path)
    default_model_path()
    # A cache of 18 of the tiny model's 32 experts: it never holds them all, so every token still
    # pins and reads (the heatmap's states; with the whole model cached a warm service does neither).
    svc = Service("--cache-mb", "2.5")
    try:
        with open_model(default_model_path()) as mf:
            index = ResidencyIndex.attach(segment_name("index", svc.pid), mf.spec)
        open_page(browser, svc.url)
        browser.execute_script("window.notReloaded = true")
        tab(browser, "live")
        points = int(browser.find_element(By.ID, "chart-ms").get_attribute("data-points"))
        tokens = svc.status()["tokens"]
        tab(browser, "chat")
        say(browser, "Tell me a story about a cache")
        wait(lambda: idle(browser) and answers(browser) and answers(browser)[0], 120, "the reply")
        shoot(browser, shots, "chat")

        def settled():  # the supervisor and the page both count telemetry's records
            now = svc.status()["tokens"]
            got = int(browser.find_element(By.ID, "chart-ms").get_attribute("data-points"))
            return (now, got) if now > tokens and got - points == now - tokens else None

        now, got = wait(settled, 20, "one chart point per token")
        assert all(
            int(browser.find_element(By.ID, c).get_attribute("data-points")) == got for c in ("chart-rate", "chart-hit", "chart-read")
        )
        tab(browser, "live")
        shoot(browser, shots, "live")
        tab(browser, "cache")

        def shown() -> tuple[int, ...]:  # the page's counts, from the cells it drew: read at once, it redraws 4 times a second
            d = browser.execute_script("const d = document.getElementById('heatmap').dataset; return [d.resident, d.pinned, d.inflight]")
            return tuple(int(x) for x in d)

        def shared() -> tuple[int, ...]:  # the index and the reader's states, in shared memory
            return int((index.table > 0).sum()), int(((index.states & PINNED) != 0).sum()), int(((index.states & INFLIGHT) != 0).sum())

        want = int((index.table > 0).sum())
        assert want > 0
        wait(lambda: shown()[0] == int((index.table > 0).sum()), 10, "the heatmap")
        # Pins and reads last only while compute works: generate until a frame shows some, then the screenshot.
        stop = threading.Event()

        def churn() -> None:
            client = svc.client()
            while not stop.is_set():
                chat(client, "Tell me a long story about experts", 64)

        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        try:

            def caught(want) -> bool:  # pins come and go within a token: keep the shot only if they were there before and after it
                if not want(*shown()[1:]):
                    return False
                browser.save_screenshot(str(shots / "web-cache.png"))
                return want(*shown()[1:])

            try:  # for the picture: a frame with both states (reads are short: such a frame is a matter of luck)
                wait(lambda: caught(lambda pinned, inflight: pinned and inflight), 20, "pinned and in-flight experts")
            except AssertionError:
                wait(lambda: caught(lambda pinned, inflight: pinned or inflight), 60, "a pinned or in-flight expert on the heatmap")
        finally:
            stop.set()
            worker.join(60)
        wait(lambda: shown() == shared(), 10, "the heatmap's counts equal to the shared index and states once idle")
        tab(browser, "config")
        assert "cache.policy" in browser.find_element(By.ID, "config").text
        shoot(browser, shots, "config")
        tab(browser, "system")

        def compute_row() -> list | None:  # [state, restarts], read at once: the table is redrawn each second
            return browser.execute_script(
                "const r = document.querySelector(\"#procs tr[data-name='compute']\"); return r && [r.dataset.state, r.dataset.restarts]"
            )

        wait(lambda: compute_row() == ["RUNNING", "0"], 20, "compute RUNNING")
        os.kill(svc.proc("compute")["pid"], signal.SIGKILL)
        wait(lambda: compute_row() == ["RUNNING", "1"], 90, "the restart in the process panel")
        shoot(browser, shots, "system")
        tab(browser, "chat")
        say(browser, "Are you back?")
        wait(lambda: idle(browser) and len(answers(browser)) == 2 and answers(browser)[1], 120, "a reply after the restart")
        assert browser.execute_script("return window.notReloaded === true")
        assert console_errors(browser) == []
        index.close()
    finally:
        svc.close()
