"""Browser safety (aioengine/server/browser_safety.py) against a real keyless `aioengine
serve` on 127.0.0.1, from Python and from a real headless chromium:

- CSRF: a POST body that is not `Content-Type: application/json` is a 415, so the page of
  another local origin whose `no-cors` text/plain fetch to /v1/load_lora_adapter is sent
  without a preflight loads no adapter (the same load sent as JSON from here does).
- DNS rebinding: a Host name other than the loopback names is a 421 (not /health), so a
  page on http://rebind.test:PORT/ (chromium maps the name to 127.0.0.1) cannot read
  completions as same-origin; with `--allowed-hosts rebind.test` the same page works.
- CORS: closed by default (no Access-Control-Allow-Origin, preflights unanswered); with
  `--allowed-origins` that origin's preflight is answered and its page reads answers.

Without chromium and chromedriver on PATH (`apt-get install chromium chromium-driver`) or
selenium, the browser tests are skipped with that reason; the others run."""
from __future__ import annotations

import functools
import http.client
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from server_process import MODEL, ServerProcess, serving

import aioengine.lora
from aioengine.server.browser_safety import (BrowserSafety, allowed_host_names,
                                             bound_to_loopback, host_name)

pytestmark = pytest.mark.slow

# The shipped example adapter: a load of it that succeeds shows in /v1/models.
PIRATE = os.path.join(os.path.dirname(aioengine.lora.__file__), "examples", "pirate")
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating")
REBIND = "rebind.test"  # chromium resolves it to 127.0.0.1 (--host-resolver-rules)
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2,
              "temperature": 0}
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  f"--host-resolver-rules=MAP {REBIND} 127.0.0.1")


@pytest.fixture(scope="module")
def other_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another local origin (http://127.0.0.1:OTHER): an empty page the browser tests run
    their scripts in, as a hostile page the user opened would."""
    root = tmp_path_factory.mktemp("other_site")
    (root / "index.html").write_text("<!doctype html><title>another site</title>")
    handler = functools.partial(QuietHandler, directory=str(root))
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()
    site.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The defaults: keyless, on 127.0.0.1, with the runtime LoRA routes of `make serve`-like
    local development."""
    yield from serving(*LORA_FLAGS)


@pytest.fixture(scope="module")
def open_server(other_site: str) -> Iterator[ServerProcess]:
    """Reached as rebind.test too (and 127.0.0.1, which the test helpers use), and readable
    by pages of `other_site`."""
    yield from serving("--allowed-hosts", REBIND, "127.0.0.1", "--allowed-origins", other_site)


def raw(server: ServerProcess, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request with exactly these headers (http.client adds
    only Host, unless given, and Content-Length: no Content-Type of its own)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def error_of(body: bytes) -> dict:
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def model_ids(server: ServerProcess) -> set[str]:
    status, body = server.request("GET", "/v1/models")
    assert status == 200, body
    return {card["id"] for card in orjson.loads(body)["data"]}


def port_of(server: ServerProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


# ---- the rules, without a server ------------------------------------------------------------

def test_host_names_and_the_default_by_bound_address() -> None:
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1" and host_name("::1") == "::1"
    assert host_name("example.com.") == "example.com"
    assert bound_to_loopback("127.0.0.1") and bound_to_loopback("127.0.0.2")
    assert bound_to_loopback("::1") and bound_to_loopback("localhost")
    assert not bound_to_loopback("0.0.0.0") and not bound_to_loopback("::")
    assert not bound_to_loopback("") and not bound_to_loopback("192.168.1.20")
    assert allowed_host_names(None, "127.0.0.2") == {"localhost", "127.0.0.1", "::1",
                                                     "127.0.0.2"}
    assert allowed_host_names(None, "0.0.0.0") is None  # any
    assert allowed_host_names(("*",), "127.0.0.1") is None
    assert allowed_host_names(("Api.Example.com:443", "[::1]"), "0.0.0.0") == {
        "api.example.com", "::1"}


def test_allowed_origins_match_as_browsers_send_them() -> None:
    listed = BrowserSafety.from_config(None, ("http://A.example:8080/",), "127.0.0.1")
    assert listed.allow_origin("http://a.example:8080") == "http://a.example:8080"
    assert listed.allow_origin("http://a.example:8081") is None
    assert listed.allow_origin("null") is None and listed.allow_origin(None) is None
    assert BrowserSafety.from_config(None, ("*",), "127.0.0.1").allow_origin("null") == "*"
    assert BrowserSafety.from_config(None, (), "127.0.0.1").allow_origin("http://x") is None


# ---- CSRF: JSON bodies only -----------------------------------------------------------------

@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "text/json",
                                          "application/jsonx"])
def test_a_body_that_is_not_json_by_type_is_a_415(server: ServerProcess,
                                                  content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, _, body = raw(server, "POST", "/v1/completions", orjson.dumps(COMPLETION), headers)
    assert status == 415, body
    error = error_of(body)
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json",
                                          "application/json; charset=utf-8",
                                          "Application/JSON;Charset=UTF-8"])
def test_json_by_any_spelling_is_served(server: ServerProcess, content_type: str) -> None:
    status, _, body = raw(server, "POST", "/tokenize", orjson.dumps({"prompt": "hi"}),
                          {"Content-Type": content_type})
    assert status == 200, body


def test_a_text_plain_lora_load_loads_nothing(server: ServerProcess) -> None:
    load = orjson.dumps({"lora_name": "plain", "lora_path": PIRATE})
    status, _, body = raw(server, "POST", "/v1/load_lora_adapter", load,
                          {"Content-Type": "text/plain;charset=UTF-8"})
    assert status == 415, body
    assert "plain" not in model_ids(server)


# ---- DNS rebinding: the Host header ---------------------------------------------------------

@pytest.mark.parametrize("host", [f"{REBIND}:PORT", "evil.example", "127.0.0.1.nip.io:PORT",
                                  "localhost.evil.example", "[::2]:PORT"])
def test_a_foreign_host_name_is_a_421(server: ServerProcess, host: str) -> None:
    headers = {"Host": host.replace("PORT", str(port_of(server)))}
    status, _, body = raw(server, "GET", "/v1/models", headers=headers)
    assert status == 421, body
    error = error_of(body)
    assert error["code"] == "misdirected_request" and "--allowed-hosts" in error["message"]
    status, _, body = raw(server, "POST", "/v1/completions", orjson.dumps(COMPLETION),
                          {**headers, "Content-Type": "application/json"})
    assert status == 421, body
    status, _, body = raw(server, "GET", "/", headers=headers)  # the chat page too
    assert status == 421, body
    # /health answers probes that send their own Host (a load balancer's, the pod's IP).
    status, _, body = raw(server, "GET", "/health", headers=headers)
    assert status == 200, body


@pytest.mark.parametrize("host", ["localhost:PORT", "LOCALHOST", "127.0.0.1:PORT",
                                  "[::1]:PORT", "chat.localhost:PORT"])
def test_the_loopback_names_are_served(server: ServerProcess, host: str) -> None:
    headers = {"Host": host.replace("PORT", str(port_of(server)))}
    status, _, body = raw(server, "GET", "/v1/models", headers=headers)
    assert status == 200, body


def test_allowed_hosts_names_the_hosts_served(open_server: ServerProcess) -> None:
    port = port_of(open_server)
    assert raw(open_server, "GET", "/v1/models", headers={"Host": f"{REBIND}:{port}"})[0] == 200
    # Named hosts replace the loopback default.
    assert raw(open_server, "GET", "/v1/models", headers={"Host": f"localhost:{port}"})[0] == 421
    assert raw(open_server, "GET", "/v1/models", headers={"Host": "evil.example"})[0] == 421


# ---- CORS -----------------------------------------------------------------------------------

def preflight(server: ServerProcess, origin: str) -> tuple[int, dict[str, str], bytes]:
    return raw(server, "OPTIONS", "/v1/chat/completions",
               headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_is_closed_by_default(server: ServerProcess, other_site: str) -> None:
    status, headers, _ = raw(server, "GET", "/v1/models", headers={"Origin": other_site})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = preflight(server, other_site)
    assert status >= 400 and "Access-Control-Allow-Origin" not in headers
    assert "Access-Control-Allow-Methods" not in headers


def test_allowed_origins_opens_cors_to_that_origin(open_server: ServerProcess,
                                                   other_site: str) -> None:
    status, headers, body = preflight(open_server, other_site)
    assert status == 204, body
    assert headers["Access-Control-Allow-Origin"] == other_site
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "GET" in headers["Access-Control-Allow-Methods"]
    allowed = headers["Access-Control-Allow-Headers"].lower()
    assert "authorization" in allowed and "content-type" in allowed
    # Answers carry it too: a stream (its head goes out before the handler returns) and an
    # error.
    status, headers, body = raw(open_server, "POST", "/v1/completions",
                                orjson.dumps({**COMPLETION, "stream": True}),
                                {"Origin": other_site, "Content-Type": "application/json"})
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    assert headers["Access-Control-Allow-Origin"] == other_site
    assert "Origin" in headers.get("Vary", "")
    status, headers, _ = raw(open_server, "POST", "/v1/completions", b"{}",
                             {"Origin": other_site, "Content-Type": "text/plain"})
    assert status == 415 and headers["Access-Control-Allow-Origin"] == other_site
    # Other origins are not told.
    status, headers, _ = preflight(open_server, "http://evil.example")
    assert status >= 400 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = raw(open_server, "GET", "/v1/models",
                             headers={"Origin": "http://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


# ---- in a real browser ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless chromium, resolving rebind.test to 127.0.0.1 (what a rebinding DNS server
    does to a page's name after the page has loaded)."""
    path, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if path is None or driver_path is None:
        pytest.skip("no chromium/chromedriver on PATH: apt-get install chromium "
                    "chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not "
                                    "installed: pip install 'aioengine[browser]'")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # selenium must never fetch a driver
    options = Options()
    options.binary_location = path
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile: Path = tmp_path_factory.mktemp("chromium-profile")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# Runs in the page: fetch(url, init), then calls back with what the page could see of the
# answer: {status, text}, {opaque: true} for a no-cors answer, or {error} when the browser
# refused it (CORS).
FETCH = """
const [url, init, done] = arguments;
fetch(url, init).then(
  async (r) => done(r.type === "opaque" ? {opaque: true}
                                         : {status: r.status, text: await r.text()}),
  (e) => done({error: String(e)}));
"""


def page_fetch(driver: Any, url: str, init: dict) -> dict:
    return driver.execute_async_script(FETCH, url, init)


def test_csrf_from_another_origin_loads_no_adapter(chromium: Any, server: ServerProcess,
                                                   other_site: str) -> None:
    chromium.get(other_site + "/")
    load = orjson.dumps({"lora_name": "csrf", "lora_path": PIRATE}).decode()
    # A "simple" request: the browser sends it without asking, the page cannot read the
    # answer.
    seen = page_fetch(chromium, server.url + "/v1/load_lora_adapter",
                      {"method": "POST", "mode": "no-cors",
                       "headers": {"Content-Type": "text/plain"}, "body": load})
    assert seen == {"opaque": True}
    assert "csrf" not in model_ids(server)
    # As JSON the browser asks first (a preflight), and is refused: nothing is sent.
    seen = page_fetch(chromium, server.url + "/v1/load_lora_adapter",
                      {"method": "POST", "headers": {"Content-Type": "application/json"},
                       "body": load})
    assert "error" in seen, seen
    assert "csrf" not in model_ids(server)
    # Nor can it read anything.
    assert "error" in page_fetch(chromium, server.url + "/v1/models", {})
    # The same load as JSON from a real client works: the attack failed on the server's
    # check, not on the adapter.
    status, body = server.request("POST", "/v1/load_lora_adapter",
                                  {"lora_name": "csrf", "lora_path": PIRATE})
    assert status == 200, body
    assert "csrf" in model_ids(server)
    status, body = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "csrf"})
    assert status == 200, body


def completion_init() -> dict:
    return {"method": "POST", "headers": {"Content-Type": "application/json"},
            "body": orjson.dumps(COMPLETION).decode()}


def test_a_rebinding_page_cannot_read_completions(chromium: Any, server: ServerProcess) -> None:
    page = f"http://{REBIND}:{port_of(server)}"
    chromium.get(page + "/")  # the attacker's page, now on the server's address
    seen = page_fetch(chromium, "/v1/completions", completion_init())
    assert seen["status"] == 421, seen
    assert "misdirected_request" in seen["text"] and "choices" not in seen["text"]
    seen = page_fetch(chromium, "/v1/models", {})
    assert seen["status"] == 421 and MODEL not in seen["text"], seen


def test_allowed_hosts_and_origins_work_in_the_browser(chromium: Any,
                                                       open_server: ServerProcess,
                                                       other_site: str) -> None:
    page = f"http://{REBIND}:{port_of(open_server)}"
    chromium.get(page + "/")  # the chat page, under the allowed name
    assert chromium.title == "aioengine chat"
    seen = page_fetch(chromium, "/v1/completions", completion_init())
    assert seen["status"] == 200, seen
    assert orjson.loads(seen["text"])["choices"][0]["text"]
    # A page of the allowed origin reads answers (its JSON POST passes the preflight).
    chromium.get(other_site + "/")
    init = completion_init()
    init["headers"]["Authorization"] = "Bearer unused"
    seen = page_fetch(chromium, open_server.url + "/v1/completions", init)
    assert seen["status"] == 200, seen
    assert orjson.loads(seen["text"])["choices"][0]["text"]
