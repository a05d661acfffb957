"""The web page at / in a real headless browser: Debian's chromium driven by
selenium through the system chromedriver, against a real `paged serve`
with --api-key (test_server_hardening's keyed server).

The page loads with the key from the address (or asks for it), a chat message streams an
answer from the real engine (the page's own text updates are recorded: more
than one growing value means it streamed), the answer equals the same
greedy request sent to the API without the page, and the engine view lists
the request with the numbers the API answered. A screenshot is saved
(under $PAGED_SCREENSHOT_DIR, else pytest's tmp dir).

Without chromium and chromedriver the test skips with the reason;
PAGED_WEB_TEST=1 (set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from test_server import shared_server
from test_server_errors import AUTH, KEY
from test_server_hardening import ERRORS_SERVER_ARGS

PROMPT = "Write one sentence about the sea."
MAX_TOKENS = 12
WAIT_S = 120

# every change to the reply's text, recorded in the page (MutationObserver)
RECORD_REPLY_TEXTS = """
window.__replyTexts = [];
new MutationObserver(() => {
  const reply = document.querySelector('#messages .assistant .text');
  if (reply && reply.textContent && window.__replyTexts.at(-1) !== reply.textContent)
    window.__replyTexts.push(reply.textContent);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""
# the recent-requests table read in one script: the page re-renders it on every poll, so rows found
# one call at a time can go stale between two calls
RECENT_ROWS = """
return [...document.querySelectorAll('#recent tbody tr')].map(
  row => [row.dataset.id ?? null, [...row.querySelectorAll('td')].map(td => td.innerText.trim())]);
"""
# pixels of the throughput line's colour (#2f6fde) on its canvas
LINE_PIXELS = """
const c = document.getElementById('plot-throughput');
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) if (d[i + 2] > 180 && d[i] < 120 && d[i + 3] > 0) n++;
return n;
"""


def browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or next(
        (p for p in ("/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver") if os.path.exists(p)), None)
    if chromium and driver:
        return chromium, driver
    reason = "chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)"
    if os.environ.get("PAGED_WEB_TEST") == "1":
        pytest.fail(reason + "; PAGED_WEB_TEST=1 requires them")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1300", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def keyed():
    return shared_server(*ERRORS_SERVER_ARGS)


def screenshot_dir(tmp_path: Path) -> Path:
    target = Path(os.environ.get("PAGED_SCREENSHOT_DIR") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def test_chat_streams_from_the_engine_and_the_engine_view_shows_it(browser, keyed, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))
    browser.get(f"{keyed.url}/?key={KEY}")
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#model option").get_attribute("value") == keyed.model)
    assert "key=" not in browser.current_url  # taken into local storage, out of the address bar
    wait.until(lambda d: d.find_element(By.ID, "kv-total").text.isdigit())  # the engine view is live

    for field, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.execute_script(RECORD_REPLY_TEXTS)
    # the shared server's earlier requests (other tests'): the page's is none of them
    before = {r["id"] for r in httpx.get(keyed.url + "/v1/engine/state", headers=AUTH).json()["recent"]}
    browser.find_element(By.ID, "prompt").send_keys(PROMPT)
    browser.find_element(By.ID, "send").click()
    reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#messages .assistant[data-finish]"))
    assert browser.find_element(By.ID, "chat-error").text == ""

    # the same greedy request without the page: the oracle for text and counts
    oracle = httpx.post(keyed.url + "/v1/chat/completions", headers=AUTH, timeout=WAIT_S, json={
        "model": keyed.model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "top_p": 1,
        "max_tokens": MAX_TOKENS}).json()
    answer = oracle["choices"][0]["message"]["content"]
    texts = browser.execute_script("return window.__replyTexts")
    assert texts[-1] == answer and answer
    assert len(texts) >= 2 and all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts  # it streamed
    assert reply.get_attribute("data-finish") == oracle["choices"][0]["finish_reason"]
    n_out = oracle["usage"]["completion_tokens"]
    assert f"{n_out} tokens" in reply.find_element(By.CSS_SELECTOR, ".meta").text

    # the engine view: the page's request listed with the numbers the API gave
    def page_row(d):
        for row_id, cells in d.execute_script(RECENT_ROWS):
            if row_id != oracle["id"] and row_id not in before and cells[0].startswith("chatcmpl"):
                return cells
        return None

    cells = wait.until(page_row)
    assert cells[1:3] == [str(oracle["usage"]["prompt_tokens"]), str(n_out)]
    assert cells[3].endswith(("ms", " s")) and cells[6] == oracle["choices"][0]["finish_reason"]
    state = httpx.get(keyed.url + "/v1/engine/state", headers=AUTH).json()
    wait.until(lambda d: d.find_element(By.ID, "kv-total").text == str(state["kv_cache"]["blocks_total"]))
    wait.until(lambda d: int(d.find_element(By.ID, "stat-finished").text) >= 2)
    assert wait.until(lambda d: d.execute_script(LINE_PIXELS) > 0)  # the tokens/s line is drawn

    shot = screenshot_dir(tmp_path) / "web-page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_without_a_key_the_page_asks_for_it(browser, keyed):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    browser.get(keyed.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    dialog = wait.until(lambda d: d.find_element(By.ID, "key-dialog"))
    wait.until(lambda d: dialog.get_attribute("open") is not None)  # the API answered 401
    assert browser.find_element(By.ID, "kv-total").text == "–"  # no data shown without the key
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#model option").get_attribute("value") == keyed.model)
    wait.until(lambda d: d.find_element(By.ID, "kv-total").text.isdigit())
    assert browser.execute_script("return localStorage.getItem('paged.apiKey')") == KEY
