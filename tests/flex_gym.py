"""attention-gym's masks and mods (attn_gym/masks, attn_gym/mods), ported as they are written
there, each under a comment naming its source file; sized for the call (N = max(L, S)) and
seeded. ``gym_cases(sizes)`` -> name -> Case, as ``flex_mods.cases``. The approximate tanh of
mods/softcapping.py (a PTX instruction lowered by inductor on CUDA) is its exact tanh here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from flex_mods import Case, Sizes, _causal_mask
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

# --- attention-gym: attn_gym/masks ------------------------------------------------------------


def _offsets_to_doc_ids_tensor(offsets: torch.Tensor) -> torch.Tensor:  # masks/document_mask.py
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)


def generate_doc_mask_mod(mask_mod: Any, offsets: torch.Tensor) -> Callable[..., Any]:
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask

    return doc_mask_mod


def generate_packed_causal_doc_mask_mod(offsets: torch.Tensor) -> Callable[..., Any]:
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_causal_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        doc_start = offsets[document_id[q_idx]]
        return (kv_idx >= doc_start) & _causal_mask(b, h, q_idx, kv_idx)

    return doc_causal_mask_mod


def generate_dilated_sliding_window(window_size: int, dilation: int) -> Callable[..., Any]:
    def dilated_sliding_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        diff = torch.abs(q_idx - kv_idx)  # masks/dilated_sliding_window.py
        in_window = diff <= window_size
        is_dilated = (diff % dilation) == 0
        return in_window & is_dilated

    return dilated_sliding_window


def generate_natten(cw: int, ch: int, kw: int, kh: int) -> Callable[..., Any]:  # masks/natten.py
    def natten_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_x, q_y = q_idx // cw, q_idx % cw
        kv_x, kv_y = kv_idx // cw, kv_idx % cw
        kernel_center_x = q_x.clamp(kw // 2, (cw - 1) - kw // 2)
        kernel_center_y = q_y.clamp(kh // 2, (ch - 1) - kh // 2)
        hori_mask = (kernel_center_x - kv_x).abs() <= kw // 2
        vert_mask = (kernel_center_y - kv_y).abs() <= kh // 2
        return hori_mask & vert_mask

    return natten_mask_mod


def generate_tiled_natten(W: int, H: int, K_W: int, K_H: int, T_W: int, T_H: int) -> Any:
    def get_x_y_tiled(idx: Any) -> Any:
        t_id = idx // (T_H * T_W)
        t_y, t_x = t_id // (W // T_W), t_id % (W // T_W)
        t_offset = idx % (T_H * T_W)
        i_y, i_x = t_offset // T_W, t_offset % T_W
        return t_x * T_W + i_x, t_y * T_H + i_y

    def tiled_natten_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_x, q_y = get_x_y_tiled(q_idx)
        kv_x, kv_y = get_x_y_tiled(kv_idx)
        kernel_x = q_x.clamp(K_W // 2, (W - 1) - K_W // 2)
        kernel_y = q_y.clamp(K_H // 2, (H - 1) - K_H // 2)
        return ((kernel_x - kv_x).abs() <= K_W // 2) & ((kernel_y - kv_y).abs() <= K_H // 2)

    return tiled_natten_mask


def _deinterleave_bits_32(code: Any) -> Any:  # masks/natten.py (morton_decode)
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    code = (code | (code >> 4)) & 0x00FF00FF
    return (code | (code >> 8)) & 0x0000FFFF


def generate_morton_natten(cw: int, ch: int, kw: int, kh: int) -> Callable[..., Any]:
    def natten_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_x, q_y = _deinterleave_bits_32(q_idx), _deinterleave_bits_32(q_idx >> 1)
        kv_x, kv_y = _deinterleave_bits_32(kv_idx), _deinterleave_bits_32(kv_idx >> 1)
        kernel_center_x = q_x.clamp(kw // 2, (cw - 1) - kw // 2)
        kernel_center_y = q_y.clamp(kh // 2, (ch - 1) - kh // 2)
        hori_mask = (kernel_center_x - kv_x).abs() <= kw // 2
        vert_mask = (kernel_center_y - kv_y).abs() <= kh // 2
        return hori_mask & vert_mask

    return natten_mask_mod


def generate_shared_prefix_mask_mod(offsets: Any, prefix_document_id: Any) -> Any:
    document_id = _offsets_to_doc_ids_tensor(offsets)  # masks/shared_prefix.py

    def shared_prefix_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_document = document_id[q_idx]
        q_document_start = offsets[q_document]
        q_prefix_document = prefix_document_id[q_document]
        q_prefix_start = offsets[q_prefix_document]
        q_prefix_end = offsets[q_prefix_document + 1]
        same_document_causal = (kv_idx >= q_document_start) & _causal_mask(b, h, q_idx, kv_idx)
        prefix_document = (
            (q_document != q_prefix_document) & (kv_idx >= q_prefix_start) & (kv_idx < q_prefix_end)
        )
        return same_document_causal | prefix_document

    return shared_prefix_mask_mod


def generate_vision_cross_attention_mask_mod(intervals: Any, image_token_length: int) -> Any:
    num_images = intervals.shape[0]  # masks/flamingo.py
    image_boundaries = torch.repeat_interleave(torch.arange(num_images), repeats=image_token_length)

    def vision_cross_attention_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        image_idx = image_boundaries[kv_idx]
        interval = intervals[image_idx]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    return vision_cross_attention_mask_mod


def generate_block_diffusion_mask(seq_len: int, block_size: int) -> Callable[..., Any]:
    def block_diffusion_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_noised = q_idx < seq_len  # masks/block_diffusion.py
        kv_noised = kv_idx < seq_len
        q_block = (q_idx % seq_len) // block_size
        kv_block = (kv_idx % seq_len) // block_size
        block_diagonal = (q_block == kv_block) & (q_noised == kv_noised)
        offset_block_causal = (q_block > kv_block) & q_noised & ~kv_noised
        block_causal = (q_block >= kv_block) & ~q_noised & ~kv_noised
        return block_diagonal | offset_block_causal | block_causal

    return block_diffusion_mask


def generate_jetspec_masks(prefix_length: int, ancestor: Any, block_size: int) -> Any:
    num_tree_nodes = ancestor.shape[0]  # masks/jetspec.py (tree-causal and training masks)
    tree_stop = prefix_length + num_tree_nodes

    def jetspec_tree_causal_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        tree_idx = (kv_idx - prefix_length).clamp(min=0, max=num_tree_nodes - 1)
        tree_visible = (kv_idx >= prefix_length) & (kv_idx < tree_stop)
        return (kv_idx < prefix_length) | (tree_visible & ancestor[q_idx, tree_idx])

    def jetspec_training_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_block = q_idx // block_size
        q_block_offset = q_idx % block_size
        kv_block_idx = kv_idx - prefix_length
        kv_block = kv_block_idx // block_size
        kv_block_offset = kv_block_idx % block_size
        same_block_causal = (
            (kv_idx >= prefix_length) & (q_block == kv_block) & (kv_block_offset <= q_block_offset)
        )
        return (kv_idx < prefix_length) | same_block_causal

    return jetspec_tree_causal_mask_mod, jetspec_training_mask_mod


def generate_sta_mask_mod_2d(canvas_hw: Any, kernel_hw: Any, tile_hw: Any, text: int) -> Any:
    (canvas_h, canvas_w), (kernel_h, kernel_w), (tile_h, tile_w) = canvas_hw, kernel_hw, tile_hw
    tile_numel = tile_h * tile_w  # masks/sta.py
    canvas_tile_h, canvas_tile_w = canvas_h // tile_h, canvas_w // tile_w
    kernel_tile_h, kernel_tile_w = kernel_h // tile_h, kernel_w // tile_w
    vision_seq_len = canvas_h * canvas_w

    def sta_mask_mod_2d(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_tile_h, q_tile_w = _tile_hw(q_idx, tile_numel, canvas_tile_w)
        kv_tile_h, kv_tile_w = _tile_hw(kv_idx, tile_numel, canvas_tile_w)
        left_h, right_h = _border(kernel_tile_h)
        left_w, right_w = _border(kernel_tile_w)
        center_h = q_tile_h.clamp(left_h, (canvas_tile_h - 1) - right_h)
        center_w = q_tile_w.clamp(left_w, (canvas_tile_w - 1) - right_w)
        h_mask = (kv_tile_h >= center_h - left_h) & (kv_tile_h <= center_h + right_h)
        w_mask = (kv_tile_w >= center_w - left_w) & (kv_tile_w <= center_w + right_w)
        return (vision_mask_and(q_idx, kv_idx, vision_seq_len, text) & h_mask & w_mask) | (
            _text_masks(q_idx, kv_idx, vision_seq_len, text)
        )

    return sta_mask_mod_2d


def _tile_hw(idx: Any, tile_numel: int, canvas_tile_w: int) -> Any:
    tile_id = idx // tile_numel
    return tile_id // canvas_tile_w, tile_id % canvas_tile_w


def _border(kernel_size: int) -> tuple[int, int]:
    return kernel_size // 2, kernel_size // 2 + (kernel_size % 2 - 1)


def vision_mask_and(q_idx: Any, kv_idx: Any, vision: int, text: int) -> Any:
    return (q_idx < vision) & (kv_idx < vision)


def _text_masks(q_idx: Any, kv_idx: Any, vision: int, text: int) -> Any:
    vision_to_text = (q_idx < vision) & (kv_idx >= vision) & (kv_idx < vision + text)
    text_to_all = (q_idx >= vision) & (kv_idx < vision + text)
    return vision_to_text | text_to_all


def generate_sta_mask_mod_3d(canvas: Any, kernel: Any, tile: Any, text: int) -> Any:
    tile_numel = tile[0] * tile[1] * tile[2]  # masks/sta.py
    ct, ch, cw = (c // t for c, t in zip(canvas, tile, strict=True))
    kt, kh, kw = (k // t for k, t in zip(kernel, tile, strict=True))
    vision_seq_len = canvas[0] * canvas[1] * canvas[2]

    def get_t_h_w_idx_tiled(idx: Any) -> Any:
        tile_id = idx // tile_numel
        return tile_id // (ch * cw), (tile_id % (ch * cw)) // cw, tile_id % cw

    def sta_mask_mod_3d(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_t, q_h, q_w = get_t_h_w_idx_tiled(q_idx)
        kv_t, kv_h, kv_w = get_t_h_w_idx_tiled(kv_idx)
        masks = []
        for q_, kv_, k_, c_ in ((q_t, kv_t, kt, ct), (q_h, kv_h, kh, ch), (q_w, kv_w, kw, cw)):
            left, right = _border(k_)
            center = q_.clamp(left, (c_ - 1) - right)
            masks.append((kv_ >= center - left) & (kv_ <= center + right))
        vision = vision_mask_and(q_idx, kv_idx, vision_seq_len, text)
        return (vision & masks[0] & masks[2] & masks[1]) | _text_masks(
            q_idx, kv_idx, vision_seq_len, text
        )

    return sta_mask_mod_3d


def generate_spatial_head_mask_mod(
    prompt_length: int, token_per_frame: int, width: int, attn_sink: bool, round_width: int
) -> Any:
    def spatial_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # masks/svg.py
        first_row_mask = q_idx < prompt_length
        if attn_sink:
            first_column_mask = kv_idx < (prompt_length + token_per_frame)
        else:
            first_column_mask = kv_idx < prompt_length
        mask_width = math.floor(width * token_per_frame / round_width) * round_width
        spatial_head_mask = torch.abs(q_idx - kv_idx) < mask_width
        return first_column_mask | first_row_mask | spatial_head_mask

    return spatial_mask_mod


def generate_temporal_head_mask_mod(
    prompt_length: int, num_frames: int, token_per_frame: int, width: int
) -> Any:
    def temporal_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # masks/svg.py
        first_row_mask = q_idx < prompt_length
        first_column_mask = kv_idx < prompt_length
        mask_width = (width * token_per_frame) // num_frames
        q_token_id = (q_idx - prompt_length) % token_per_frame
        kv_token_id = (kv_idx - prompt_length) % token_per_frame
        temporal_head_mask = torch.abs(q_token_id - kv_token_id) < mask_width
        return first_column_mask | first_row_mask | temporal_head_mask

    return temporal_mask_mod


def generate_vsa_mask_mods(topk: Any, block_map: Any, tile_numel: int, sizes: Any) -> Any:
    def vsa_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # masks/vsa.py
        q_tile = q_idx // tile_numel
        kv_tile = kv_idx // tile_numel
        selected_tiles = topk[b, h, q_tile]
        selected = (selected_tiles == kv_tile.unsqueeze(-1)).any(dim=-1)
        return selected & (kv_idx % tile_numel < sizes[kv_tile])

    def vsa_block_map_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_tile = q_idx // tile_numel
        kv_tile = kv_idx // tile_numel
        return block_map[b, h, q_tile, kv_tile]

    return vsa_mask_mod, vsa_block_map_mask_mod


def batchify_mask_mod(mask_mod: Any, batchify_size: int) -> Any:  # masks/batchify.py
    def batched_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        same_batch = (q_idx // batchify_size) == (kv_idx // batchify_size)
        inner_mask = mask_mod(b, h, q_idx % batchify_size, kv_idx % batchify_size)
        return same_batch & inner_mask

    return batched_mask_mod


# --- attention-gym: attn_gym/mods -------------------------------------------------------------


def generate_alibi_bias(H: int) -> Callable[..., Any]:
    def alibi_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


def generate_tanh_softcap(soft_cap: int) -> Callable[..., Any]:  # mods/softcapping.py
    def tanh_softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return soft_cap * torch.tanh(score / soft_cap)

    return tanh_softcap


def generate_activation_score_mod(offset: float = 1.0) -> Callable[..., Any]:
    def activation_score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.log(torch.nn.functional.gelu(score) + offset)  # mods/activation.py

    return activation_score_mod


def generate_graphormer_biases(spatial_bias: Any, distances: Any, edge: tuple[Any, ...]) -> Any:
    edge_bias, path_edge_types, path_lengths = edge  # mods/graphormer.py
    position_tables = [edge_bias[:, n] for n in range(path_edge_types.shape[-1])]

    def graphormer_spatial_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + spatial_bias[h, distances[b, q_idx, kv_idx]]

    def graphormer_edge_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        length = path_lengths[b, q_idx, kv_idx]
        total = 0.0
        for n, table in enumerate(position_tables):
            contrib = table[h, path_edge_types[b, q_idx, kv_idx, n]]
            total = total + torch.where(length > n, contrib, 0.0)
        return score + total / torch.clamp(length, min=1)

    return graphormer_spatial_bias, graphormer_edge_bias


def generate_mla_rope_score_mod(query_rope: Any, key_rope: Any, num_heads: int) -> Any:
    def mla_rope_score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + (  # mods/latent_attention.py (scale 1.0)
            1.0 * torch.dot(query_rope[b, h, q_idx], key_rope[b, h // num_heads, kv_idx])
        )

    return mla_rope_score_mod


def generate_sandwich_bias(H: int, max_seq_len: int, d_bar: int = 128) -> Any:
    freqs = 1.0 / 10000 ** (2 * torch.arange(d_bar // 2, dtype=torch.float32) / d_bar)
    padded_len = -(-(2 * max_seq_len - 1) // 8) * 8  # mods/sandwich.py
    distances = torch.arange(padded_len, dtype=torch.float32) - (max_seq_len - 1)
    rel_bias = torch.cos(distances.abs()[:, None] * freqs).sum(dim=-1)
    offset = max_seq_len - 1
    head_scale = H / (8.0 * torch.arange(1, H + 1, dtype=torch.float32))

    def sandwich_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + rel_bias[q_idx - kv_idx + offset] * head_scale[h]

    return sandwich_mod


# --- the cases -------------------------------------------------------------------------------


def gym_masks(s: Sizes) -> dict[str, Case]:
    n, gen = s.n, s.gen
    lengths = [n // 7, n // 5, n // 3]
    offsets = torch.tensor([0, *lengths, n - sum(lengths)], dtype=torch.int32).cumsum(0)
    offsets = offsets.to(torch.int32)
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    ancestor = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents[1:], start=1):
        ancestor[node] |= ancestor[parent]
    tree, training = generate_jetspec_masks(10, ancestor, 12)
    tiles = math.ceil(n / 16)
    topk = torch.randint(0, tiles, (s.batch, s.heads, tiles, 3), generator=gen)
    block_map = torch.rand(s.batch, s.heads, tiles, tiles, generator=gen) < 0.3
    vsa, vsa_map = generate_vsa_mask_mods(
        topk, block_map, 16, torch.randint(1, 17, (tiles,), generator=gen)
    )
    is_global = torch.zeros(n, dtype=torch.bool)
    is_global[[0, n // 2]] = True
    intervals = torch.tensor([[0, n // 2], [n // 4, n], [n // 2, n]], dtype=torch.int32)

    def window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # masks/sliding_window.py
        return q_idx - kv_idx <= 40

    return {
        "gym causal_mask": Case(None, _causal_mask),
        "gym sliding_window": Case(None, and_masks(window, _causal_mask)),
        "gym prefix_lm": Case(None, or_masks(lambda b, h, q, kv: kv < 50, _causal_mask)),
        "gym doc_mask_mod causal": Case(None, generate_doc_mask_mod(_causal_mask, offsets)),
        "gym doc_mask_mod noop": Case(None, generate_doc_mask_mod(noop_mask, offsets)),
        "gym packed_causal_doc": Case(None, generate_packed_causal_doc_mask_mod(offsets)),
        "gym dilated_sliding_window": Case(None, generate_dilated_sliding_window(30, 3)),
        "gym natten": Case(None, generate_natten(20, 15, 5, 3)),
        "gym tiled_natten": Case(None, generate_tiled_natten(20, 15, 5, 5, 5, 5)),
        "gym morton_natten": Case(None, generate_morton_natten(16, 16, 5, 5)),
        "gym global_sliding_window": Case(
            None,
            or_masks(
                lambda b, h, q, kv: (q - kv).abs() <= 20,
                lambda b, h, q, kv: is_global[q] | is_global[kv],
            ),
        ),
        "gym shared_prefix": Case(
            None,
            generate_shared_prefix_mask_mod(offsets, torch.tensor([0, 0, 2, 2], dtype=torch.int32)),
        ),
        "gym flamingo": Case(None, generate_vision_cross_attention_mask_mod(intervals, n // 3 + 1)),
        "gym batchify causal": Case(None, batchify_mask_mod(_causal_mask, 24)),
        "gym block_diffusion": Case(None, generate_block_diffusion_mask(n // 2, 16)),
        "gym jetspec tree causal": Case(None, tree),
        "gym jetspec training": Case(None, training),
        "gym sta 2d": Case(None, generate_sta_mask_mod_2d((12, 20), (6, 10), (2, 5), n - 240)),
        "gym sta 3d": Case(
            None, generate_sta_mask_mod_3d((3, 8, 10), (3, 8, 10), (1, 4, 5), n - 240)
        ),
        "gym svg spatial": Case(None, generate_spatial_head_mask_mod(20, 40, 2, True, 16)),
        "gym svg temporal": Case(None, generate_temporal_head_mask_mod(20, 7, 40, 2)),
        "gym vsa": Case(None, vsa),
        "gym vsa block map": Case(None, vsa_map),
    }


def gym_mods(s: Sizes) -> dict[str, Case]:
    n, gen = s.n, s.gen
    spatial = s.randn(s.heads, 6, learned=True)
    distances = torch.randint(0, 6, (s.batch, n, n), generator=gen, dtype=torch.int32)
    edge_bias = s.randn(s.heads, 3, 4, learned=True)
    path_types = torch.randint(0, 4, (s.batch, n, n, 3), generator=gen, dtype=torch.int32)
    path_lengths = torch.randint(0, 4, (s.batch, n, n), generator=gen, dtype=torch.int32)
    spatial_mod, edge_mod = generate_graphormer_biases(
        spatial, distances, (edge_bias, path_types, path_lengths)
    )
    query_rope, key_rope = s.randn(s.batch, s.heads, n, 4), s.randn(s.batch, 1, n, 4)
    return {
        "gym alibi": Case(generate_alibi_bias(s.heads), None),
        "gym tanh_softcap": Case(generate_tanh_softcap(2), None),
        "gym activation (gelu)": Case(generate_activation_score_mod(), None),
        "gym graphormer spatial": Case(spatial_mod, None, (spatial,)),
        "gym graphormer edge": Case(edge_mod, None, (edge_bias,)),
        "gym mla rope": Case(generate_mla_rope_score_mod(query_rope, key_rope, s.heads), None),
        "gym sandwich": Case(generate_sandwich_bias(s.heads, n), None),
    }


def gym_cases(s: Sizes) -> dict[str, Case]:
    return {**gym_masks(s), **gym_mods(s)}
