"""Escaping and the content security policy for the self-contained HTML pages.

Why: every string on the page can come from a trace (correlation ids, queue ids, config labels, run
ids), and any local process can post a trace to the loopback receiver. Text and attributes go through
``html.escape``; data for scripts goes into a ``<script type="application/json">`` block through
``script_json`` (no ``<``, ``>`` or ``&`` survive, so neither ``</script>`` nor ``<!--`` can end or
swallow the block); scripts build the DOM with ``textContent``. The policy from ``csp_meta`` is the
second wall: only the page's own inline script and style (by hash) run, images only from ``data:``,
nothing is fetched.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from typing import Any

import orjson

_SCRIPT_DATA_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026",
                        0x2028: "\\u2028", 0x2029: "\\u2029"}


def script_json(value: Any) -> str:
    """``value`` as JSON that is inert inside any ``<script>`` element and parses back unchanged."""
    return orjson.dumps(value).decode().translate(_SCRIPT_DATA_ESCAPES)


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def csp_meta(scripts: Iterable[str] = (), styles: Iterable[str] = ()) -> str:
    """A ``<meta>`` content security policy allowing exactly these inline scripts and styles (their
    text as it appears between the tags) and ``data:`` images; everything else is refused."""
    script_src = " ".join(_sha256(s) for s in scripts) or "'none'"
    style_src = " ".join(_sha256(s) for s in styles) or "'none'"
    policy = (f"default-src 'none'; script-src {script_src}; style-src {style_src}; img-src data:; "
              "base-uri 'none'; form-action 'none'")
    return f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
