"""The chat page at `/`: plain HTML, JavaScript and CSS shipped in the package
(aioengine/server/static/), no build step, nothing fetched from elsewhere. The page talks
to the /v1 routes like any client (with --api-key it asks for the key), so its own files
are static and served without the key (PAGE_PATHS)."""
from __future__ import annotations

from importlib import resources

from aiohttp import web

# URL path -> (file under static/, content type).
PAGE_FILES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html"),
    "/static/chat.js": ("chat.js", "text/javascript"),
    "/static/chat.css": ("chat.css", "text/css"),
}
PAGE_PATHS = frozenset(PAGE_FILES)


def add_chat_page(app: web.Application) -> None:
    """GET routes for the page's files, read once now."""
    static = resources.files("aioengine.server") / "static"
    for path, (name, content_type) in PAGE_FILES.items():
        body = (static / name).read_bytes()

        async def page_file(request: web.Request, body: bytes = body,
                            content_type: str = content_type) -> web.Response:
            return web.Response(body=body, content_type=content_type, charset="utf-8",
                                headers={"Cache-Control": "no-cache"})
        app.router.add_get(path, page_file)
