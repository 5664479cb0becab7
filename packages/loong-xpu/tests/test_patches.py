import pytest
import torch

from loong_xpu import MANIFEST, apply_patches, get_accelerator, redirect_cuda
from loong_xpu.patches import _resolve

# names megatron binds only where TE / apex import (layers.get_dummy_wgrad, fused_weight_gradient_mlp_cuda)
BOUND_BY_TE_OR_APEX = {"get_dummy_wgrad", "fused_weight_gradient_mlp_cuda", "apply_fused_qkv_rotary_pos_emb"}
ADDED_BY_LOONG = {"loong_drop_grad_accumulation_hooks"}  # a method the manifest adds to megatron's DDP


def test_every_patch_names_a_real_target_and_a_reason():
    assert len({p.target for p in MANIFEST}) == len(MANIFEST)
    for patch in MANIFEST:
        owner, attr = _resolve(patch.target)
        assert hasattr(owner, attr) or attr in BOUND_BY_TE_OR_APEX | ADDED_BY_LOONG, patch.target
        assert not (patch.wraps and attr in BOUND_BY_TE_OR_APEX | ADDED_BY_LOONG), patch.target
        assert len(patch.reason) > 10


def test_cuda_calls_land_on_the_cpu_and_everything_is_restored():
    originals = {p.target: getattr(*_resolve(p.target), None) for p in MANIFEST}
    with redirect_cuda(get_accelerator("cpu")) as patches:
        assert len(patches.applied) == len(MANIFEST) + 1
        assert torch.cuda.current_device() == 0
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu"
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"  # what megatron asserts on
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        stream.wait_event(event)
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
        state = torch.cuda.get_rng_state()
        x = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(4), x)
    for target, original in originals.items():
        assert getattr(*_resolve(target), None) is original, target
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_patching_twice_is_refused_and_leaves_nothing_half_done():
    acc = get_accelerator("cpu")
    first = apply_patches(acc)
    try:
        with pytest.raises(RuntimeError, match="already patched"):
            apply_patches(acc)
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # the first set still works
    finally:
        first.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_backend_patches_only_the_apex_stand_in_and_megatron_corrections():
    patches = apply_patches(get_accelerator("cuda"))
    try:
        assert patches.applied == ["megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda",
                                   "megatron.core.models.gpt.gpt_model:process_mtp_loss",
                                   "megatron.core.transformer.multi_latent_attention:MLASelfAttention._qkv_down_projection",
                                   "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel."
                                   "loong_drop_grad_accumulation_hooks",
                                   "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.scale_gradients",
                                   "megatron.core.transformer.attention:apply_fused_qkv_rotary_pos_emb",
                                   "megatron.core.optimizer.optimizer:ChainedOptimizer.get_grad_norm",
                                   "megatron.core.optimizer.optimizer:ChainedOptimizer.step_with_ready_grads",
                                   "megatron.core.transformer.experimental_attention_variant.absorbed_mla:"
                                   "AbsorbedMLASelfAttention.__init__",
                                   "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer."
                                   "_register_param_copy_back_gpu_hook",
                                   "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer."
                                   "build_cpu_optimizer_list"]  # fmt: skip
    finally:
        patches.remove()


def test_megatron_optimizer_kernels_are_host_ones_on_redirected_devices(monkeypatch):
    """With TE installed megatron binds TE's CUDA-only optimizer kernels at import (they crash on
    host tensors). Stand those bindings in with markers, as on a TE machine, and check the redirect
    swaps in megatron's host implementations and restores the bindings afterwards."""
    import megatron.core.optimizer as megatron_optimizer
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    def cuda_only(*args, **kwargs):
        raise AssertionError("a CUDA-only kernel ran on the host")

    bindings = {
        (megatron_optimizer, "USING_PYTORCH_OPTIMIZER"): False,
        (megatron_optimizer, "Adam"): cuda_only,
        (clip_grads, "multi_tensor_applier"): cuda_only,
        (clip_grads, "l2_norm_impl"): cuda_only,
        (clip_grads, "multi_tensor_scale_impl"): cuda_only,
        (optimizer, "multi_tensor_applier"): cuda_only,
        (optimizer, "multi_tensor_scale_impl"): cuda_only,
    }
    for (module, name), value in bindings.items():
        monkeypatch.setattr(module, name, value)
    with redirect_cuda(get_accelerator("cpu")):
        assert megatron_optimizer.USING_PYTORCH_OPTIMIZER is True
        assert megatron_optimizer.Adam is torch.optim.AdamW
        assert clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier
        assert clip_grads.l2_norm_impl is not cuda_only  # Loong's fp64-accumulating norm (next test)
        assert optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale
        # and megatron's norm computation now runs on host tensors
        grads = [torch.ones(3), torch.ones(4)]
        norm = clip_grads.multi_tensor_applier(
            clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int), [grads], False
        )[0]
        assert torch.allclose(norm, torch.tensor(7.0).sqrt())
    for (module, name), value in bindings.items():
        assert getattr(module, name) is value


def test_host_gradient_norm_is_exact_where_megatrons_fallback_is_not():
    """A large gradient with a few big entries (an embedding's rows of frequent tokens): megatron's
    fp32 fallback drifts from the exact norm, the patched one agrees with fp64 to fp32 rounding."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    g = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    g[:64] = 3.0
    grads = [g, torch.randn(1000, generator=torch.Generator().manual_seed(1))]
    exact = torch.cat([t.double() for t in grads]).norm().item()

    def rel(norm_impl) -> float:
        return abs(utils.local_multi_tensor_applier(norm_impl, None, [grads], False)[0].item() - exact) / exact

    with redirect_cuda(get_accelerator("cpu")):
        assert rel(clip_grads.l2_norm_impl) < 1e-7
        assert rel(utils.local_multi_tensor_l2_norm) > 1e-6  # what TP=2 on the CPU used to see


def test_moe_dispatcher_split_sizes_become_host_numpy():
    # The EP all-to-all hands these to all_to_all_single as split sizes (a list-like of ints).
    from megatron.core.transformer.moe import token_dispatcher

    with redirect_cuda(get_accelerator("cpu")):
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 5]), as_numpy=True)
        assert splits.tolist() == [3, 5] and not torch.is_tensor(splits)
        count = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor(7))
        assert torch.is_tensor(count) and count.device.type == "cpu"
        assert token_dispatcher.maybe_move_tensor_to_cpu(None) is None


def test_recomputed_forwards_keep_the_device_redirect():
    # Activation recompute runs the forward again inside backward(), where torch has the device
    # mode switched off; megatron's _fork_rng patch turns it back on there.
    from megatron.core.tensor_parallel.random import checkpoint

    with redirect_cuda(get_accelerator("cpu")):
        x = torch.ones(3, requires_grad=True)
        y = checkpoint(lambda t: t * torch.full((3,), 2.0, device=torch.cuda.current_device()), False, x)
        y.sum().backward()
        assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_megatron_context_parallel_rope_slice_runs_on_the_host():
    """megatron pins the CP rank's RoPE chunk index in host memory; pinning needs CUDA."""
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    class TwoRanks:  # the group interface the function reads
        def size(self):
            return 2

        def rank(self):
            return 1

    emb = torch.arange(8.0).reshape(8, 1, 1, 1)
    with redirect_cuda(get_accelerator("cpu")):
        local = get_pos_emb_on_this_cp_rank(emb, 0, TwoRanks())
    # rank 1 of 2 holds chunks 1 and 2 of 4 (load-balanced zigzag)
    assert local.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("owner, attr", [
    ("megatron.core.optimizer.optimizer:ChainedOptimizer", "step_with_ready_grads"),
    ("megatron.core.transformer.multi_latent_attention:MLASelfAttention", "_qkv_down_projection"),
    ("megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer", "_register_param_copy_back_gpu_hook"),
])  # fmt: skip
def test_a_megatron_without_what_a_patch_wraps_fails_naming_the_patch(monkeypatch, owner, attr):
    """A megatron-core that renamed a method a patch wraps: applying the manifest stops with one
    line naming the patch, and nothing stays patched."""
    cls, _ = _resolve(f"{owner}.{attr}")
    monkeypatch.delattr(cls, attr)
    before = torch.cuda.current_device
    with pytest.raises(RuntimeError, match=rf"^loong_xpu patch {owner}.{attr}: {attr} is gone from "
                                           r"\w+ \(the installed version changed what this patch wraps\)$"):  # fmt: skip
        apply_patches(get_accelerator("cpu"))
    assert torch.cuda.current_device is before and torch.zeros(1, device="meta").device.type == "meta"
    assert not any(k.startswith("_loong_original_") for k in vars(cls))


def test_the_patches_of_megatron_methods_are_in_place_while_applied_and_gone_after():
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from loong_xpu.patches import is_applied

    targets = [p.target for p in MANIFEST if ":ChainedOptimizer." in p.target or ":DistributedDataParallel." in p.target]
    norm, update = ChainedOptimizer.get_grad_norm, ChainedOptimizer.step_with_ready_grads
    with redirect_cuda(get_accelerator("cpu")):
        assert len(targets) == 3 and all(is_applied(t) for t in targets)
        assert ChainedOptimizer.get_grad_norm.__wrapped__ is norm  # megatron's, wrapped
        assert callable(DistributedDataParallel.loong_drop_grad_accumulation_hooks)
    assert not any(is_applied(t) for t in targets)
    assert (ChainedOptimizer.get_grad_norm, ChainedOptimizer.step_with_ready_grads) == (norm, update)
    assert not hasattr(DistributedDataParallel, "loong_drop_grad_accumulation_hooks")


def test_the_non_finite_step_skip_outside_the_patch_set_names_the_patch_it_needs():
    from loong_xpu.nonfinite_step import step_unless_nonfinite

    with pytest.raises(RuntimeError, match=r"^the non-finite step skip needs loong_xpu's patch megatron.core.optimizer."
                                           r"optimizer:ChainedOptimizer.get_grad_norm: run the step inside "
                                           r"loong_xpu.redirect_cuda$"):  # fmt: skip
        step_unless_nonfinite(object())  # refused before the optimizer is touched
