"""The chat page at `/` in a real headless browser: Debian's chromium and chromedriver,
driven by selenium, against a real `aioengine serve` on the bundled model.

A message is sent and its answer seen streaming in (the text grows while the Stop button
is live), with TTFT and tokens/s shown; the second turn carries the first (the
conversation is kept); a long answer is stopped mid-way and the server's running count
and KV usage return to 0 (the abort reached the engine); a screenshot is saved under the
test's tmp_path and checked to be a PNG. With --api-key the page asks for the key,
refuses a wrong one, and works once the right one is entered, while the page's own files
are served without it and /v1 stays closed. With --reasoning-parser (a tiny thinking model
whose template opens `<think>`), the reasoning streams into a collapsed <details> above the
answer, never into the answer.

Without chromium and chromedriver on PATH (`apt-get install chromium chromium-driver`) or
selenium (`pip install 'aioengine[browser]'`) the module is skipped with that reason."""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from server_process import API_KEY, ServerProcess, serving

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no chromium/chromedriver on PATH: apt-get install chromium chromium-driver",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver",
                                reason="selenium is not installed: pip install "
                                       "'aioengine[browser]'")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

# Headless chromium as root, talking to nobody but the test server.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1200,900")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def wait_for(condition: Callable[[], Any], timeout: float = 60, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium must never fetch a driver
    options = Options()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving()


@pytest.fixture(scope="module")
def key_server() -> Iterator[ServerProcess]:
    yield from serving("--api-key", API_KEY)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from thinking_models import make_thinking_model_dir

    model = make_thinking_model_dir(tmp_path_factory.mktemp("r1") / "r1", "deepseek_r1")
    yield from serving(str(model), "--dtype", "float32", "--reasoning-parser", "deepseek_r1")


def open_page(driver: Any, server: ServerProcess) -> None:
    driver.get(server.url + "/")
    assert driver.title == "aioengine chat"


def wait_ready(driver: Any) -> None:
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"), 30,
             "the model list")


def set_value(driver: Any, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def send(driver: Any, text: str) -> Any:
    """Sends `text`; returns the answer's element."""
    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    set_value(driver, "prompt", text)
    driver.find_element(By.ID, "send").click()
    return wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before:],
                    10, "the answer's bubble")[0]


def answer_text(answer: Any) -> str:
    return answer.find_element(By.CLASS_NAME, "text").text


def finished(answer: Any) -> str | None:
    return answer.get_attribute("data-finish")


def test_chat_streams_keeps_the_conversation_and_stops(browser: Any, server: ServerProcess,
                                                       tmp_path: Path) -> None:
    open_page(browser, server)
    wait_ready(browser)
    assert browser.find_element(By.ID, "model").get_attribute("value") == server.model
    set_value(browser, "temperature", "0")
    set_value(browser, "max_tokens", "48")
    first = send(browser, "What is the capital of France? Answer in one sentence.")
    seen: list[str] = []  # the text each time it changed while streaming
    while not finished(first):
        text = answer_text(first)
        if text and (not seen or text != seen[-1]):
            seen.append(text)
        time.sleep(0.01)
    assert len(seen) >= 2, f"no streaming seen: {seen}"  # text arrived piece by piece
    assert finished(first) in ("stop", "length")
    assert "Paris" in answer_text(first)
    stats = first.find_element(By.CLASS_NAME, "stats").text
    assert "TTFT" in stats and "tokens/s" in stats, stats
    assert float(first.get_attribute("data-ttft-ms")) > 0
    assert float(first.get_attribute("data-tokens-per-second")) > 0
    server.wait_idle()

    # The second turn sends the first with it, and is stopped mid-way.
    prompt_tokens = server.metrics()["aioengine:prompt_tokens_total"]
    set_value(browser, "max_tokens", "3000")
    set_value(browser, "temperature", "0.8")
    second = send(browser, "Now write a very long story about a dragon who learns to cook.")
    wait_for(lambda: len(answer_text(second)) > 60, 60, "the story to start")
    assert server.metrics()["aioengine:num_requests_running"] == 1
    assert not finished(second)
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: finished(second) == "stopped", 10, "the answer to stop")
    idle = server.wait_idle(timeout=10)
    assert idle["aioengine:num_requests_running"] == 0
    assert idle["aioengine:num_requests_waiting"] == 0
    assert idle["aioengine:kv_cache_usage_perc"] == 0
    generated = idle["aioengine:generation_tokens_total"]
    time.sleep(0.5)
    assert server.metrics()["aioengine:generation_tokens_total"] == generated  # it stopped
    # Its prompt held the first question and answer too.
    second_prompt = idle["aioengine:prompt_tokens_total"] - prompt_tokens
    assert second_prompt > len(answer_text(first).split()) + 20
    assert browser.find_element(By.ID, "send").is_enabled()
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == 4

    shot = tmp_path / "chat-page.png"
    assert browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    data = shot.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000


def test_api_key_is_asked_for_and_the_page_works_with_it(browser: Any,
                                                         key_server: ServerProcess,
                                                         tmp_path: Path) -> None:
    # The page's files are static and open; the API behind them is not.
    assert key_server.request("GET", "/")[0] == 200
    assert key_server.request("GET", "/static/chat.js")[0] == 200
    assert key_server.request("GET", "/v1/models")[0] == 401
    open_page(browser, key_server)
    dialog = browser.find_element(By.ID, "api-key-dialog")
    wait_for(dialog.is_displayed, 10, "the key dialog")
    assert not browser.find_elements(By.CSS_SELECTOR, "#model option")
    set_value(browser, "api-key", "wrong-key")
    browser.find_element(By.ID, "api-key-save").click()
    wait_for(lambda: "refused" in browser.find_element(By.ID, "api-key-error").text, 10,
             "the wrong key refused")
    assert dialog.is_displayed()
    set_value(browser, "api-key", API_KEY)
    browser.find_element(By.ID, "api-key-save").click()
    wait_ready(browser)
    assert not dialog.is_displayed()
    set_value(browser, "max_tokens", "12")
    answer = send(browser, "Say hello.")
    wait_for(lambda: finished(answer), 60, "the answer")
    assert finished(answer) in ("stop", "length") and answer_text(answer)
    key = browser.execute_script("return sessionStorage.getItem('aioengine-api-key')")
    assert key == API_KEY
    shot = tmp_path / "chat-page-api-key.png"
    assert browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    assert shot.read_bytes().startswith(PNG_SIGNATURE)


def test_reasoning_is_shown_collapsed_above_the_answer(browser: Any,
                                                       thinking_server: ServerProcess) -> None:
    """The template opens the reasoning and the random model never closes it within
    max_tokens: everything it writes is reasoning, in the <details>, none in the answer."""
    open_page(browser, thinking_server)
    wait_ready(browser)
    set_value(browser, "temperature", "0")
    set_value(browser, "max_tokens", "16")
    answer = send(browser, "What is 2 + 2?")
    wait_for(lambda: finished(answer), 60, "the answer")
    details = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.is_displayed() and details.get_attribute("open") is None  # collapsed
    reasoning = details.find_element(By.CLASS_NAME, "reasoning-text")
    thought = reasoning.get_attribute("textContent")
    assert thought and "think>" not in thought
    assert "think>" not in answer_text(answer)
    body = answer.find_element(By.CLASS_NAME, "text")
    # Above the answer: the details come first in the bubble.
    assert details.location["y"] < body.location["y"] or not answer_text(answer)
    details.find_element(By.TAG_NAME, "summary").click()
    wait_for(lambda: reasoning.is_displayed(), 10, "the reasoning to open")
    assert reasoning.text.strip() == thought.strip()
