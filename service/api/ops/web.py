"""GET / — a page to try the service in a browser, and the few static files it is made of.

The page talks only to its own origin (relative URLs), so it works the same behind Nginx.
Files are revalidated on every load (ETag → 304): there is no build step to version their names.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, abort, send_from_directory

web_api = Blueprint("web", __name__)
STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
# Explicit, not guessed from the system's mime.types; Werkzeug adds "; charset=utf-8" to text types.
CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
# Nothing but this origin: no CDN, no third-party requests; previews are blob: URLs.
PAGE_POLICY = (
    "default-src 'self'; img-src 'self' blob: data:; connect-src 'self'; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def _send(name: str):
    content_type = CONTENT_TYPES.get(Path(name).suffix)
    if content_type is None:
        abort(404)
    response = send_from_directory(STATIC_DIR, name, mimetype=content_type, conditional=True, etag=True)
    response.cache_control.public = False
    response.cache_control.max_age = None
    response.cache_control.no_cache = True
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


@web_api.get("/")
def page():
    """The try-it page."""
    response = _send("index.html")
    response.headers["Content-Security-Policy"] = PAGE_POLICY
    return response


@web_api.get("/static/<path:name>")
def static_file(name: str):
    """The page's script, style sheet and images."""
    return _send(name)
