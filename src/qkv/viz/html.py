"""The self-contained interactive HTML viewer: one file, no network, everything inline.

Head view: the tokens twice (as queries on the left, as keys on the right) linked by lines whose
strength is the weight, and the weight matrix beside them; hover a token to focus it, click to
pin it, pick the layer and head. Model view: every layer × head as a thumbnail; click one to open
it. The weights travel as uint8 (weight × 255), deflate-compressed and base64-encoded, so 512
tokens × 6 layers × 12 heads stay a few megabytes; the page draws with canvas.

Safety: every piece of user text (tokens, title) goes in as JSON data inside a
``<script type="application/json">`` element with ``<``, ``>`` and ``&`` escaped, and the page
inserts it with ``textContent`` only. A Content-Security-Policy forbids every network load and
allows only the page's own script and stylesheet (by hash).

The page itself is three plain files in ``static/``: ``viewer.html`` (the template),
``viewer.css`` and ``viewer.js`` (vanilla JavaScript: it reads its data from the
``<script type="application/json">`` element, inflates the weights with the browser's own
``DecompressionStream`` and draws with canvas; user text reaches the page through
``textContent`` only).
Legend: H heads, Lq query length, Lk key length.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import zlib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.viz._data import AttentionMaps, collect

VIEWS = ("head", "model")
# The page's template, stylesheet and script: plain files beside this module (``static/``).
_STATIC = resources.files("qkv.viz") / "static"
PAGE, CSS, JS = (
    (_STATIC / name).read_text(encoding="utf-8")
    for name in ("viewer.html", "viewer.css", "viewer.js")
)


class AttentionView:
    """An interactive view of attention weights; ``html()`` is the whole page.

    In a notebook it displays itself (``_repr_html_``, in a sandboxed frame); ``save(path)``
    writes a single HTML file that opens offline in any current browser.
    """

    def __init__(
        self,
        maps: AttentionMaps,
        *,
        layer: int | None = None,
        head: int = 0,
        token: int | None = None,
        view: str = "head",
        title: str | None = None,
        subtitle: str | None = None,
    ) -> None:
        self.maps = maps
        self.layer_row = maps.row(layer)
        maps.head(layer, head)  # checks the head index
        self.head = head
        if token is not None and not 0 <= token < len(maps.query_tokens):
            raise ValueError(f"token must be in [0, {len(maps.query_tokens) - 1}], got {token}")
        self.token = token
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        self.view = view
        self.title = title if title is not None else "Attention weights"
        self.subtitle = subtitle if subtitle is not None else " ".join(maps.key_tokens[:60])

    def __repr__(self) -> str:
        layers, heads, lq, lk = self.maps.weights.shape
        return f"AttentionView({layers} layers × {heads} heads, {lq}×{lk} tokens)"

    def payload(self) -> dict[str, Any]:
        """The data the page reads (JSON-serialisable)."""
        maps = self.maps
        _, heads, lq, lk = maps.weights.shape
        quantised = np.clip(np.rint(maps.weights * 255.0), 0, 255).astype(np.uint8)
        blocked = None if maps.blocked is None else maps.blocked.astype(np.uint8)
        return {
            "title": self.title,
            "subtitle": self.subtitle,
            "layers": maps.layer_names,
            "heads": heads,
            "lq": lq,
            "lk": lk,
            "queryTokens": maps.query_tokens,
            "keyTokens": maps.key_tokens,
            "weights": _pack(quantised),
            "blocked": None if blocked is None else _pack(blocked),
            "initial": {
                "layer": self.layer_row,
                "head": self.head,
                "token": self.token,
                "view": self.view,
            },
        }

    def html(self) -> str:
        """The complete, self-contained HTML document."""
        data = script_json(self.payload())
        policy = (
            "default-src 'none'; "
            f"script-src {_csp_hash(JS)}; style-src {_csp_hash(CSS)}; "
            "img-src data: blob:; base-uri 'none'; form-action 'none'"
        )
        return PAGE.format(
            policy=policy,  # our own constant: no quotes or markup to escape
            title=html.escape(self.title),
            css=CSS,
            data=data,
            js=JS,
        )

    def save(self, path: str | Path) -> Path:
        """Write the page to ``path`` (UTF-8); returns the path."""
        path = Path(path)
        path.write_text(self.html(), encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        # A sandboxed frame keeps the page's script, ids and policy apart from the notebook's.
        document = html.escape(self.html(), quote=True)
        height = 760 if max(self.maps.weights.shape[-2:]) > 24 else 620
        return (
            f'<iframe sandbox="allow-scripts" srcdoc="{document}" '
            f'style="width: 100%; height: {height}px; border: 1px solid #e4e7ec; '
            f'border-radius: 8px;"></iframe>'
        )


def view(
    source: Any,
    tokens: Sequence[str] | None = None,
    *,
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    batch: int = 0,
    mask: torch.Tensor | None = None,
    layer: int | None = None,
    head: int = 0,
    token: int | None = None,
    start: str = "head",
    title: str | None = None,
    subtitle: str | None = None,
) -> AttentionView:
    """An interactive view of ``source``: a ``qkv.trace()`` result, an ``AttentionRecord``, a
    weights tensor ((Lq, Lk), (H, Lq, Lk) or (layers, H, Lq, Lk)) or a sequence of per-layer
    tensors (H, Lq, Lk) / (B, H, Lq, Lk), e.g. a Hugging Face model's ``outputs.attentions``.

    ``tokens`` label the positions; ``layer``, ``head`` and ``token`` (a query position) are
    what the page opens on, in the ``start`` view ("head" or "model"). ``mask`` (bool (Lq, Lk),
    True = may attend) shows blocked cells for a tensor source. Save with ``.save(path)``.
    """
    maps = collect(
        source, tokens, query_tokens=query_tokens, key_tokens=key_tokens, batch=batch, mask=mask
    )
    return AttentionView(
        maps,
        layer=layer,
        head=head,
        token=token,
        view=start,
        title=title,
        subtitle=subtitle,
    )


def script_json(value: Any) -> str:
    """JSON that is safe inside a ``<script>`` element: ``<``, ``>``, ``&`` (so no
    ``</script>`` or ``<!--``) and the JavaScript line separators are written as escapes."""
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _pack(array: np.ndarray) -> str:
    """uint8 array -> deflate (zlib format, what ``DecompressionStream("deflate")`` reads)
    -> base64 text."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(array).tobytes(), 6)).decode()


def _csp_hash(source: str) -> str:
    digest = hashlib.sha256(source.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"
