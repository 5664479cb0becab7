"""Multimodal step data: packs padded only as far as the layout needs (padding tokens cost the
LLM's GEMMs like real ones), the same samples and tokens whatever the padding."""

import pytest
import torch

from loong_data.step_data import DataConfig, MultimodalDataConfig, PatchGeometry, StepLayout, build_step_data
from loong_data.step_data.layout import DataError
from loong_data.step_data.multimodal import prefetch_mode

SEQ = 1024


def steps(tmp_path, prefetch="thread", **layout):
    cfg = DataConfig(kind="multimodal", packing="thd", seq_length=SEQ, cache_dir=str(tmp_path / "cache"),
                     multimodal=MultimodalDataConfig(max_pixels=112 * 112, video_max_pixels=56 * 56, prefetch=prefetch))  # fmt: skip
    lay = StepLayout(micro_batch_size=1, global_batch_size=8, num_microbatches=1, eval_iters=1, seed=0, **layout)
    data = build_step_data(cfg, lay, patches=PatchGeometry(patch_size=14, temporal_patch_size=2, merge_size=2))
    it = data.train_steps()
    return [mb for _ in range(2) for mb in next(it)]


@pytest.mark.parametrize("multiple", [128, 96])
def test_packs_are_padded_to_the_layouts_multiple_not_to_seq_length(tmp_path, multiple):
    full, short = steps(tmp_path), steps(tmp_path, pack_multiple=multiple)
    assert all(mb["tokens"].shape == (1, SEQ) for mb in full)
    assert len(full) == len(short) and any(mb["tokens"].shape[1] < SEQ for mb in short)
    for a, b in zip(full, short):
        n, real = b["tokens"].shape[1], int(a["cu_seqlens"][-2])  # the full pack's last segment: padding
        assert n % multiple == 0 or n == SEQ, n
        assert real <= n < real + multiple  # no whole multiple of padding
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(a[key][:, :n], b[key]), key
        assert torch.equal(a["cu_seqlens"][:-1], b["cu_seqlens"][: len(a["cu_seqlens"]) - 1])
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            assert torch.equal(a[key], b[key]), key


def test_steps_prefetched_in_a_child_process_equal_the_threads_steps(tmp_path):
    """data.multimodal.prefetch=process: the same micro-batches, tensor for tensor, in the same order."""
    ref, child = steps(tmp_path), steps(tmp_path, prefetch="process")
    assert len(ref) == len(child)
    for a, b in zip(ref, child):
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key], key


def test_child_process_prefetch_refuses_a_balancer(tmp_path):
    cfg = DataConfig(kind="multimodal", packing="thd", seq_length=SEQ, cache_dir=str(tmp_path / "cache"),
                     multimodal=MultimodalDataConfig(max_pixels=112 * 112, prefetch="process"))  # fmt: skip
    lay = StepLayout(micro_batch_size=1, global_batch_size=8, num_microbatches=1, eval_iters=1, seed=0)
    data = build_step_data(cfg, lay, patches=PatchGeometry(patch_size=14, temporal_patch_size=2, merge_size=2))
    with pytest.raises(DataError, match="prefetch=process"):
        data.train_steps(balancer=object())


def test_auto_prefetch_takes_the_child_process_only_for_cuda_runs_without_a_balancer():
    assert prefetch_mode("auto", cuda=True, balanced=False) == "process"
    assert prefetch_mode("auto", cuda=False, balanced=False) == "thread"
    assert prefetch_mode("auto", cuda=True, balanced=True) == "thread"
    assert prefetch_mode("thread", cuda=True, balanced=False) == "thread"
    assert prefetch_mode("process", cuda=False, balanced=False) == "process"
    assert MultimodalDataConfig().prefetch == "auto" and not MultimodalDataConfig().errors()


def test_an_unknown_prefetch_mode_is_a_config_error():
    assert any("data.multimodal.prefetch='fork'" in e for e in MultimodalDataConfig(prefetch="fork").errors())


def test_a_cpu_layout_leaves_the_steps_in_pageable_memory(tmp_path):
    """Pinning (for asynchronous copies) is for CUDA devices only; a host run keeps its tensors."""
    assert not any(t.is_pinned() for mb in steps(tmp_path, device=torch.device("cpu")) for t in mb.values()
                   if isinstance(t, torch.Tensor))  # fmt: skip


@pytest.mark.gpu
def test_a_cuda_layout_gets_its_steps_in_pinned_memory(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    mbs = steps(tmp_path, device=torch.device("cuda"))
    # an empty tensor (no video in the pack) has no memory to pin and reports is_pinned() False
    assert all(t.is_pinned() for mb in mbs for t in mb.values() if isinstance(t, torch.Tensor) and t.numel())

