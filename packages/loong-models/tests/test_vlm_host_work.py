"""The host bookkeeping of a VLM micro-batch (multimodal positions, the ViT's patch coordinates,
frames and windows) runs once per micro-batch on the host, in front of the GPU work: it must equal
the per-item computation (HF's positions per document, each image's own geometry) and cost a number
of tensor ops that does not grow with the pack's text or its images."""


import pytest
import torch

from loong_models import VisionTokenIds, mrope_positions
from loong_models.image_encoder.grid import frame_cu_seqlens, patch_coordinates, window_partition
from loong_models.testing import IMG, VID, AtenOpCounter, hf_rope_index, vision_tokens


def _document(g: torch.Generator, caption: int, images: int):
    """A bench-like sample: a caption of distinct text tokens around ``images`` images of random
    sizes and one video clip; returns (tokens, image grids, video grids, seconds)."""
    text = lambda n: torch.randint(10, 8000, (n,), generator=g).tolist()  # noqa: E731
    grids = [(1, 2 * int(torch.randint(1, 5, (1,), generator=g)), 2 * int(torch.randint(1, 5, (1,), generator=g)))
             for _ in range(images)]  # fmt: skip
    tokens = text(3)
    for grid in grids:
        tokens += vision_tokens(IMG, grid) + text(caption)
    tokens += vision_tokens(VID, (2, 4, 2)) + text(2)
    return tokens, grids, [(2, 4, 2)], [0.5]


def _pack(seed: int, docs: int, caption: int, images: int):
    g = torch.Generator().manual_seed(seed)
    parts = [_document(g, caption, images) for _ in range(docs)]
    tokens = torch.tensor([sum((p[0] for p in parts), [])])
    cu = torch.tensor([0, *torch.tensor([len(p[0]) for p in parts]).cumsum(0).tolist()], dtype=torch.int32)
    grids = lambda i: torch.tensor([x for p in parts for x in p[i]])  # noqa: E731
    return parts, dict(input_ids=tokens, ids=VisionTokenIds(IMG, VID), spatial_merge_size=2, image_grid_thw=grids(1),
                       video_grid_thw=grids(2), second_per_grid_ts=[s for p in parts for s in p[3]],
                       tokens_per_second=2, cu_seqlens=cu)  # fmt: skip


def test_mrope_positions_of_a_bench_like_pack_match_hf_per_document():
    parts, kwargs = _pack(seed=1, docs=3, caption=40, images=4)
    ours = mrope_positions(**kwargs)
    hf = []
    for tokens, images, videos, seconds in parts:
        hf.append(hf_rope_index(tokens, torch.tensor(images), torch.tensor(videos), torch.tensor(seconds)))
    torch.testing.assert_close(ours, torch.cat(hf, dim=-1), rtol=0, atol=0)


def _ops(fn, *args, **kwargs) -> int:
    with AtenOpCounter() as counter:
        fn(*args, **kwargs)
    return counter.calls


def test_mrope_positions_cost_does_not_grow_with_the_text():
    # a walk over the tokens made tensors for every text token (~250 runs in a 4k-token pack)
    short = _ops(mrope_positions, **_pack(seed=2, docs=3, caption=5, images=4)[1])
    long = _ops(mrope_positions, **_pack(seed=2, docs=3, caption=300, images=4)[1])
    assert long == short


def test_mrope_positions_pay_one_op_per_vision_item_and_one_layout_per_size():
    # documents of text + one video clip of one size: its layout is made once per call, and each
    # clip costs its in-place add (a few aten ops: the slices, the add), not a layout of its own
    one = _ops(mrope_positions, **_pack(seed=3, docs=1, caption=20, images=0)[1])
    more = _ops(mrope_positions, **_pack(seed=3, docs=8, caption=20, images=0)[1])
    assert (more - one) / 7 <= 4


def _grid(n: int, sizes=((1, 32, 32),)) -> torch.Tensor:
    return torch.tensor([sizes[i % len(sizes)] for i in range(n)])


GRIDS = [_grid(5, ((1, 32, 32), (2, 8, 12), (1, 6, 10), (1, 32, 32))), _grid(1, ((3, 4, 4),)), _grid(12)]


@pytest.mark.parametrize("grid", GRIDS, ids=["mixed", "video", "bench"])
def test_vit_geometry_of_a_micro_batch_equals_each_images_own(grid):
    rows, cols = patch_coordinates(grid, 2)
    order, cu, longest = window_partition(grid, 2, 4)
    frames, frame_longest = frame_cu_seqlens(grid)
    ref = {k: [] for k in ("rows", "cols", "order", "lens", "frames")}
    blocks = 0
    for g in grid:
        one = g[None]
        r, c = patch_coordinates(one, 2)
        o, w, _ = window_partition(one, 2, 4)
        f, _ = frame_cu_seqlens(one)
        ref["rows"].append(r), ref["cols"].append(c), ref["order"].append(o + blocks)
        ref["lens"] += w.diff().tolist()
        ref["frames"] += f.diff().tolist()
        blocks += int(g.prod()) // 4
    assert torch.equal(rows, torch.cat(ref["rows"])) and torch.equal(cols, torch.cat(ref["cols"]))
    assert torch.equal(order, torch.cat(ref["order"]))
    assert cu.tolist() == [0, *torch.tensor(ref["lens"]).cumsum(0).tolist()] and longest == max(ref["lens"])
    assert frames.tolist() == [0, *torch.tensor(ref["frames"]).cumsum(0).tolist()]
    assert frame_longest == max(ref["frames"]) and cu.dtype == frames.dtype == torch.int32
    # the windows are a permutation of the blocks
    assert torch.equal(order.sort().values, torch.arange(blocks))


@pytest.mark.parametrize(
    "fn", [patch_coordinates, lambda g, m: window_partition(g, m, 4)], ids=["coords", "windows"]
)
def test_vit_geometry_costs_the_same_ops_for_2_or_16_equal_images(fn):
    assert _ops(fn, _grid(2), 2) == _ops(fn, _grid(16), 2)


@pytest.mark.parametrize("bias_dropout_add, bias_activation", [(True, True), (False, True), (True, False)])
def test_compiled_fusions_switch_off_in_the_foundation_and_follow_into_the_encoder(
    bias_dropout_add, bias_activation
):
    # model.fuse_bias_dropout_add / fuse_bias_activation: the TE backend's torch.compile'd fusions
    from loong_models import FoundationConfig, ImageEncoderConfig, build_transformer_config, fusion_fields
    from loong_models.image_encoder import build_encoder_transformer_config

    fields = fusion_fields("te", bias_dropout_add=bias_dropout_add, bias_activation=bias_activation)
    fields["apply_rope_fusion"] = False  # needs TE installed (a VLM's foundation runs without it anyway)
    base = build_transformer_config(FoundationConfig(), params_dtype=torch.float32, **fields)
    enc = build_encoder_transformer_config(
        ImageEncoderConfig(), base, tensor_model_parallel_size=1, backend="te"
    )
    assert (base.bias_dropout_fusion, base.bias_activation_fusion) == (bias_dropout_add, bias_activation)
    assert (enc.bias_dropout_fusion, enc.bias_activation_fusion) == (bias_dropout_add, bias_activation)
    assert fusion_fields("local", bias_dropout_add=True)["bias_dropout_fusion"] is False  # TE only
