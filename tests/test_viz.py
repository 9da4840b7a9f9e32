"""qkv.viz: heatmaps with content and labels, and the self-contained HTML viewer's page."""

from __future__ import annotations

import base64
import html
import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
from qkv import viz

imread = pytest.importorskip("matplotlib.image").imread

TOKENS = ["The", "cat", "sat", "on", "the", "mat", "."]
HOSTILE = ["<script>alert(1)</script>", '"><img src=x onerror=alert(2)>', "</script><b>x", "&amp;"]


def traced(tokens: list[str], *, heads: int = 2, layers: int = 2, causal: bool = False):
    model = torch.nn.Sequential(
        *[qkv.SelfAttention(8 * heads, heads, causal=causal) for _ in range(layers)]
    )
    with qkv.trace(model) as t:
        model(torch.randn(1, len(tokens), 8 * heads) * 3)
    t.tokens = tokens
    return t


def pixels(path: Path) -> np.ndarray:
    image = imread(path)
    return image[..., :3] if image.ndim == 3 else image


def test_heatmap_png_has_content_and_token_labels(tmp_path: Path) -> None:
    t = traced(TOKENS, causal=True)
    figure = viz.heatmap(t, layer=1, head=1)
    ax = figure.axes[0]
    assert [label.get_text() for label in ax.get_xticklabels()] == TOKENS
    assert [label.get_text() for label in ax.get_yticklabels()] == TOKENS
    assert "layer 1, head 1" in ax.get_title()
    # the drawn cells are the weights, blocked cells masked (drawn grey)
    drawn = ax.images[0].get_array()
    assert drawn.mask[0, 1] and not drawn.mask[1, 0]  # causal: key 1 blocked for query 0
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(drawn.filled(0.0))), t.layer(1).weights[0, 1].float()
    )
    path = viz.save(figure, tmp_path / "head.png")
    image = pixels(path)
    assert image.shape[0] > 200 and image.shape[1] > 200
    assert image.std() > 0.1  # not blank


def test_head_grid_draws_every_head(tmp_path: Path) -> None:
    t = traced(TOKENS, heads=4, layers=1)
    figure = viz.head_grid(t, layer=0)
    panels = [ax for ax in figure.axes if ax.images]
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(4)]
    assert [label.get_text() for label in panels[0].get_xticklabels()] == TOKENS
    for h, ax in enumerate(panels):
        np.testing.assert_allclose(ax.images[0].get_array(), t[0].weights[0, h].numpy(), 1e-6)
    image = pixels(viz.save(figure, tmp_path / "grid.png"))
    assert image.std() > 0.1


def test_long_inputs_thin_labels_and_keep_peaks_when_shrunk(tmp_path: Path) -> None:
    length = 1000
    weights = torch.full((length, length), 0.2 / length)
    weights[700, 333] = 0.8  # one sharp peak
    tokens = [f"t{i}" for i in range(length)]
    figure = viz.heatmap(weights, tokens, max_labels=40, max_cells=250)
    ax = figure.axes[0]
    labels = [label.get_text() for label in ax.get_xticklabels()]
    assert 20 <= len(labels) <= 40 and labels[0] == "t0"
    assert all(label in tokens for label in labels)
    drawn = np.asarray(ax.images[0].get_array())
    assert drawn.shape == (250, 250)  # max-pooled 4×4 blocks
    assert drawn.max() == pytest.approx(0.8)  # the peak survives the shrinking
    assert "4×4 block" in ax.get_title()
    assert pixels(viz.save(figure, tmp_path / "long.png")).std() > 0.01


def test_svg_escapes_hostile_labels(tmp_path: Path) -> None:
    t = traced(HOSTILE, layers=1)
    path = viz.save(viz.heatmap(t), tmp_path / "head.svg")
    text = path.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "<script" not in text and "<img" not in text
    assert "&lt;script&gt;alert(1" in text and "&lt;/script&gt;&lt;b&gt;x" in text


def test_sources_and_bad_input() -> None:
    weights = torch.softmax(torch.randn(3, 4, 4), -1)
    maps = viz.collect(weights)  # (H, Lq, Lk) is one layer
    assert maps.weights.shape == (1, 3, 4, 4) and maps.query_tokens == ["0", "1", "2", "3"]
    per_layer = [torch.softmax(torch.randn(2, 3, 4, 4), -1) for _ in range(2)]  # HF attentions
    maps = viz.collect(per_layer, batch=1)
    np.testing.assert_allclose(maps.weights[1], per_layer[1][1].numpy())
    with pytest.raises(ValueError, match="one label per position"):
        viz.heatmap(weights, ["a", "b"])
    with pytest.raises(ValueError, match="head must be in"):
        viz.heatmap(weights, head=3)
    with pytest.raises(ValueError, match="layer must be one of"):
        viz.heatmap(traced(TOKENS), layer=5)
    with pytest.raises(TypeError, match="source must be"):
        viz.heatmap("weights")
    with pytest.raises(ValueError, match="weights must have shape"):
        viz.heatmap(torch.rand(4))
    with qkv.trace() as empty:
        pass
    with pytest.raises(ValueError, match="no attention weights"):
        viz.view(empty)


def page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match.group(1))


def unpack(text: str, shape: tuple[int, ...]) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(text))
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def test_html_is_self_contained_and_escapes_user_text(tmp_path: Path) -> None:
    t = traced(HOSTILE + TOKENS, causal=True)
    page = viz.view(t, title="<b>title</b>").html()
    # one inline data block and one inline script; nothing loaded from anywhere
    assert page.count("<script") == 2 and page.count("</script>") == 2
    markup = page.replace(re.search(r'id="qkv-data">(.*?)</script>', page, re.S).group(1), "")
    assert not re.search(r"\b(src|href)\s*=", markup)
    assert "http://" not in page and "https://" not in page and "@import" not in page
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)
    assert policy is not None and "default-src 'none'" in policy.group(1)
    assert "<b>" not in page and "<img" not in page and "alert(1)</script>" not in page
    assert "<title>&lt;b&gt;title&lt;/b&gt;</title>" in page
    data = page_data(page)
    assert data["queryTokens"][: len(HOSTILE)] == HOSTILE  # intact, as data
    weights = unpack(data["weights"], (2, 2, 11, 11)) / 255
    expected = torch.stack([r.weights[0] for r in t]).numpy()
    np.testing.assert_allclose(weights, expected, atol=0.5 / 255 + 1e-6)
    blocked = unpack(data["blocked"], (11, 11)).astype(bool)
    np.testing.assert_array_equal(blocked, ~qkv.causal_mask(11, 11).numpy())
    path = viz.view(t).save(tmp_path / "view.html")
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_policy_hashes_match_the_inline_script_and_style() -> None:
    import hashlib

    static = Path(viz.__file__).parent / "static"  # the stylesheet and script, as files
    page = viz.view(torch.rand(2, 2)).html()
    for source in (
        (static / name).read_text(encoding="utf-8") for name in ("viewer.js", "viewer.css")
    ):
        digest = base64.b64encode(hashlib.sha256(source.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in page
        assert source in page


def test_repr_html_is_a_sandboxed_frame() -> None:
    t = traced(HOSTILE)
    frame = viz.view(t)._repr_html_()
    assert frame.startswith('<iframe sandbox="allow-scripts" srcdoc="')
    document = html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1))
    assert document == viz.view(t).html()
    assert "<script>alert" not in frame


def test_view_options_are_checked() -> None:
    t = traced(TOKENS)
    assert page_data(viz.view(t, layer=1, head=1, token=3, start="model").html())["initial"] == {
        "layer": 1,
        "head": 1,
        "token": 3,
        "view": "model",
    }
    with pytest.raises(ValueError, match="token must be in"):
        viz.view(t, token=7)
    with pytest.raises(ValueError, match="view must be one of"):
        viz.view(t, start="graph")
    assert "2 layers × 2 heads" in repr(viz.view(t))
