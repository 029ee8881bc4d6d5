"""Browser safety: what keeps a web page the user visits from using a server on their machine.

A keyless `aioengine serve` on 127.0.0.1 is reachable by every page the local browser
opens. Three checks close that (one middleware, before the API key's, and one response
hook; OpenAIServer.build_app installs both):

- CSRF. Any page may POST anywhere without asking first, as long as the request is "simple"
  (Content-Type text/plain, a form, or none); it cannot read the answer, but the request
  runs (an adapter loads, tokens are spent). So every POST must say `Content-Type:
  application/json`, which a browser sends to another origin only after a CORS preflight
  that is answered only for --allowed-origins: anything else is a 415.
- DNS rebinding. A page on http://rebind.example:8000/ whose name the attacker then points
  at 127.0.0.1 is same-origin with the server and reads every answer; but its requests say
  `Host: rebind.example:8000`. The Host name must be one the server is known by, else 421.
  Default: bound to a loopback address, the loopback names (and the bound one); bound to
  anything else (0.0.0.0, a LAN address), any name: a server on a network is reached by
  names it cannot know, and --allowed-hosts should then name them. /health is exempt: load
  balancers and Kubernetes probe it with their own Host (the backend's IP), and a page that
  reads it learns only that a server is there, which it can tell from timing anyway.
  A request without a Host header is let through: browsers always send one.
- CORS stays closed (no Access-Control-Allow-Origin, preflights unanswered) unless
  --allowed-origins names the page's origin ("*": any).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import hdrs, web

from aioengine.server.protocol import ApiError

logger = logging.getLogger("aioengine.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Names that resolve only to this machine (RFC 6761: `localhost` and every name under it).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY = "*"
JSON_TYPE = "application/json"
# Paths served whatever the Host (see the module docstring).
ANY_HOST_PATHS = frozenset({"/health"})
# What a preflight from an allowed origin is told (its requested headers are echoed: the
# origin is trusted, and browser clients such as openai-node send their own x-* headers).
CORS_METHODS = "GET, POST"
CORS_MAX_AGE_S = 600


def host_name(value: str) -> str:
    """The name of a Host header (or an --allowed-hosts entry): no port, an IPv6 address
    without its brackets, lower case, no trailing dot."""
    value = value.strip()
    if value.startswith("["):
        name = value[1:].split("]", 1)[0]
    elif value.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        name = value.split(":", 1)[0]
    else:
        name = value
    return name.lower().rstrip(".")


def bound_to_loopback(host: str) -> bool:
    """Whether a server bound to `host` (ServerConfig.host) listens on loopback only. A
    name is resolved as bind_socket resolves it (its first address); a name that does not
    resolve counts as loopback, so the strict default applies."""
    if host_name(host) in ("", "0.0.0.0", "::"):
        return False
    if host_name(host) == "localhost" or host_name(host).endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host_name(host))
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return True
        address = ipaddress.ip_address(infos[0][4][0].split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def allowed_host_names(allowed: tuple[str, ...] | None, bind_host: str) -> frozenset[str] | None:
    """The Host names served (None: any), from --allowed-hosts and the bound address."""
    if allowed is None:
        if not bound_to_loopback(bind_host):
            return None
        return LOOPBACK_NAMES | {host_name(bind_host)}
    if ANY in allowed:
        return None
    return frozenset(host_name(h) for h in allowed)


def is_json_type(content_type: str | None) -> bool:
    """Whether a Content-Type header is application/json (any parameters, any case). The
    type is what comes before the first ';', as a browser reads it when it decides whether
    a request is "simple"."""
    return (content_type is not None
            and content_type.split(";", 1)[0].strip().lower() == JSON_TYPE)


def origin_key(origin: str) -> str:
    """An origin as browsers send it: scheme://host[:port], lower case, no path."""
    return origin.strip().rstrip("/").lower()


@dataclass(frozen=True)
class BrowserSafety:
    hosts: frozenset[str] | None  # None: any Host
    origins: frozenset[str]  # origin_key()s, or {"*"}

    @classmethod
    def from_config(cls, allowed_hosts: tuple[str, ...] | None,
                    allowed_origins: tuple[str, ...], bind_host: str) -> BrowserSafety:
        hosts = allowed_host_names(allowed_hosts, bind_host)
        if hosts is None and allowed_hosts is None:
            logger.info("bound to %s, not a loopback address: any Host name is served; "
                        "--allowed-hosts names the ones clients use (DNS rebinding)",
                        bind_host or "every address")
        origins = frozenset({ANY} if ANY in allowed_origins
                            else (origin_key(o) for o in allowed_origins))
        return cls(hosts, origins)

    def host_allowed(self, host: str | None) -> bool:
        if self.hosts is None or host is None:
            return True
        name = host_name(host)
        return name in self.hosts or ("localhost" in self.hosts
                                      and name.endswith(".localhost"))

    def allow_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for a request's Origin (None: not allowed)."""
        if origin is None or not self.origins:
            return None
        if ANY in self.origins:
            return ANY
        return origin if origin_key(origin) in self.origins else None

    def middleware(self) -> Callable:
        """Host check, CORS preflight, JSON-only POST bodies (in that order, before the API
        key's check: a preflight carries no key)."""

        @web.middleware
        async def browser_safety(request: web.Request, handler: Handler) -> web.StreamResponse:
            host = request.headers.get(hdrs.HOST)
            if request.path not in ANY_HOST_PATHS and not self.host_allowed(host):
                raise ApiError(421, f"this server does not answer to the Host name "
                               f"{host_name(host or '')!r} (--allowed-hosts; a guard "
                               "against DNS rebinding)", code="misdirected_request")
            if (request.method == hdrs.METH_OPTIONS
                    and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers
                    and self.allow_origin(request.headers.get(hdrs.ORIGIN)) is not None):
                return self._preflight(request)
            if (request.method == hdrs.METH_POST
                    and not is_json_type(request.headers.get(hdrs.CONTENT_TYPE))):
                got = request.headers.get(hdrs.CONTENT_TYPE)
                raise ApiError(415, f"the request body must be sent as Content-Type: "
                               f"{JSON_TYPE}, got {got!r}", code="unsupported_media_type")
            return await handler(request)
        return browser_safety

    def _preflight(self, request: web.Request) -> web.Response:
        headers = {hdrs.ACCESS_CONTROL_ALLOW_METHODS: CORS_METHODS,
                   hdrs.ACCESS_CONTROL_MAX_AGE: str(CORS_MAX_AGE_S)}
        asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS)
        headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = asked or "Authorization, Content-Type"
        # Chromium's Private Network Access: a public page asks before it calls localhost.
        if request.headers.get("Access-Control-Request-Private-Network") == "true":
            headers["Access-Control-Allow-Private-Network"] = "true"
        return web.Response(status=204, headers=headers)

    async def add_cors_headers(self, request: web.Request,
                               response: web.StreamResponse) -> None:
        """on_response_prepare: every answer (errors and SSE streams included, whose headers
        go out before their handler returns) to an allowed origin says so."""
        allowed = self.allow_origin(request.headers.get(hdrs.ORIGIN))
        if allowed is not None:
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = allowed
            if allowed != ANY:
                response.headers.add(hdrs.VARY, hdrs.ORIGIN)

    def install(self, app: web.Application) -> None:
        """The response hook (the middleware goes in the app's middleware list)."""
        app.on_response_prepare.append(self.add_cors_headers)
