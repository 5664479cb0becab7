"""The one place where megatron-core (and torch.cuda, on its behalf) is patched for a device.

megatron-core is written for CUDA: it calls ``torch.cuda.current_device()``, passes
``device="cuda"`` to factory functions, calls ``.cuda()`` and keeps its tensor-parallel RNG
streams in CUDA generators. On any other backend these calls are redirected to the active
accelerator, so megatron's own modules, optimizer and schedules run unmodified.

Every patch is listed in :data:`MANIFEST` with the reason it exists. :func:`redirect_cuda`
applies all of them and :meth:`PatchSet.remove` undoes them, restoring the originals. A few
patches supply a piece megatron-core otherwise takes from apex, or correct megatron on every
device (``on_cuda``): those also apply on CUDA, where nothing needs redirecting.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from loong_xpu.accelerator import Accelerator
from loong_xpu.log import logger


@dataclass(frozen=True)
class Patch:
    """``target`` (``module:attribute`` or ``module:Class.attribute``) is replaced by
    ``make(accelerator)`` while active; an attribute the module lacks is added and deleted again.
    ``on_cuda``: applied on CUDA too. ``wraps``: the replacement wraps the original, so a
    megatron-core without it (it changed what the patch relies on) fails naming the patch."""

    target: str
    reason: str
    make: Callable[[Accelerator], object]
    on_cuda: bool = False
    wraps: bool = False


def _wgrad_kernels(accel: Accelerator) -> types.ModuleType:
    from loong_xpu import wgrad

    return wgrad


def _is_cuda(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch reads a bare index as a CUDA ordinal
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _DeviceRedirectMode(TorchFunctionMode):
    """Rewrites CUDA ``device`` arguments and ``Tensor.cuda`` to the accelerator's device, and
    makes ``Tensor.type()`` report CUDA type names there (megatron asserts on them). On a host
    (cpu) target it also drops ``pin_memory=True``: pinning needs a CUDA host allocator, and
    megatron pins its context-parallel RoPE index (``get_pos_emb_on_this_cp_rank``)."""

    def __init__(self, accel: Accelerator):
        super().__init__()
        self.target = accel.device()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            # .cuda(device=None, non_blocking=False, memory_format=...)
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            return args[0].to(self.target, non_blocking=non_blocking)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device == self.target:
            # megatron asserts grad.type() == "torch.cuda.FloatTensor" (clip_grads, DDP buffers):
            # on the redirected device, a tensor reports the CUDA type name of its dtype.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if kwargs.get("pin_memory") and self.target.type == "cpu":
            kwargs["pin_memory"] = False
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs["device"] = self.target
        elif func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], self.target, *args[2:])
        return func(*args, **kwargs)


def _megatron_util(name: str):
    from megatron.core import utils

    return getattr(utils, name)


def _rng_state_of(accel: Accelerator):
    def get_rng_state(device: object = "cuda", *_, **__) -> torch.Tensor:
        return accel.get_rng_state()

    return get_rng_state


def _set_rng_state_of(accel: Accelerator):
    def set_rng_state(new_state: torch.Tensor, device: object = -1, *_, **__) -> None:
        accel.set_rng_state(new_state)

    return set_rng_state


def _host_copy_of(accel: Accelerator):
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        # megatron's version copies only CUDA tensors, so on another device the all-to-all split
        # sizes stay tensors and torch's all_to_all_single rejects them: copy any non-host tensor,
        # and give numpy where asked whichever device the tensor is on.
        if not torch.is_tensor(tensor):
            return tensor
        host = tensor.to("cpu")
        return host.numpy() if as_numpy else host

    return maybe_move_tensor_to_cpu


def _exact_l2_norm_of(accel: Accelerator):
    def l2_norm(chunk_size: int, noop_flag, tensor_lists, per_tensor: bool, *args):
        # megatron's host fallback (utils.local_multi_tensor_l2_norm) sums squares in fp32, which
        # on the CPU loses up to ~1e-3 relative on a large gradient (the embedding's): enough to
        # clip differently under TP=2 than in one process. Accumulate in fp64, round once.
        norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensor_lists[0]]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float64)
        per = torch.stack(norms).float().to(accel.device()) if per_tensor and norms else None
        return total.float().reshape(1).to(accel.device()), per

    return l2_norm


def _recompute_context_of(accel: Accelerator):
    from megatron.core.tensor_parallel import random as mrandom

    original = mrandom._fork_rng

    @contextlib.contextmanager
    def _fork_rng():
        # torch runs the backward pass inside the device mode's handler of Tensor.backward, where
        # that mode is off: forwards recomputed there (activation checkpointing) would see CUDA
        # devices again. megatron wraps every recomputation in _fork_rng, so enter the mode there.
        with original(), _DeviceRedirectMode(accel):
            yield

    return _fork_rng


def _dummy_wgrad_of(accel: Accelerator):
    def get_dummy_wgrad(shape: list[int], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        # the placeholder weight gradient a fused linear returns (its real one is in main_grad);
        # zeros whatever ``zero`` says: DDP adds it to a tied weight's other gradient
        return torch.zeros(shape, dtype=dtype, device=accel.device())

    return get_dummy_wgrad


def _made_by(module: str, factory: str) -> Callable[[Accelerator], object]:
    """The replacement that ``loong_xpu.<module>.<factory>(accel)`` builds, imported when the
    manifest is applied (these modules import megatron-core, which plain ``import loong_xpu`` must not)."""

    def make(accel: Accelerator) -> object:
        return getattr(importlib.import_module(f"loong_xpu.{module}"), factory)(accel)

    return make


MANIFEST: tuple[Patch, ...] = (
    Patch(
        "torch.cuda:current_device",
        "megatron allocates buffers and parameters with device=torch.cuda.current_device()",
        lambda a: lambda: a.current_device_index(),
    ),
    Patch(
        "torch.cuda:synchronize",
        "megatron synchronizes around timers, checkpoint saves and the distributed optimizer",
        lambda a: lambda device=None: a.synchronize(),
    ),
    Patch(
        "torch.cuda:get_rng_state",
        "megatron's CudaRNGStatesTracker.add() seeds and reads CUDA generators directly",
        _rng_state_of,
    ),
    Patch(
        "torch.cuda:set_rng_state",
        "the RNG tracker restores the original CUDA generator state after seeding a stream",
        _set_rng_state_of,
    ),
    Patch(
        "torch.cuda:manual_seed",
        "model_parallel_cuda_manual_seed() and the RNG tracker seed CUDA generators",
        lambda a: lambda seed: a.manual_seed(seed),
    ),
    Patch(
        "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        "forking the TP RNG stream (dropout, TP weight init) and activation recompute read the "
        "CUDA generator through this helper, which indexes torch.cuda.default_generators",
        _rng_state_of,
    ),
    Patch(
        "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        "restoring a forked RNG stream goes through torch.cuda.default_generators as well",
        _set_rng_state_of,
    ),
    Patch(
        "torch.cuda:current_stream",
        "DDP's grad sync waits on CUDA-graph events through torch.cuda.current_stream()",
        lambda a: lambda device=None: a.current_stream(),
    ),
    Patch(
        "torch.cuda:default_stream",
        "megatron orders communication against the default stream with torch.cuda.default_stream()",
        lambda a: lambda device=None: a.current_stream(),
    ),
    Patch(
        "torch.cuda:Stream",
        "overlapped DP communication, activation offload and the pipeline create side streams",
        lambda a: a.Stream,
    ),
    Patch(
        "torch.cuda:stream",
        "side streams are entered as context managers (torch.cuda.stream(s)) around overlapped work",
        lambda a: a.stream,
    ),
    Patch(
        "torch.cuda:set_stream",
        "megatron restores the current stream after overlapped work with torch.cuda.set_stream",
        lambda a: lambda stream: a.set_stream(stream),
    ),
    Patch(
        "torch.cuda:Event",
        "communication overlap and timers order and time work with CUDA events",
        lambda a: a.Event,
    ),
    Patch(
        "torch.cuda:empty_cache",
        "megatron releases cached memory after checkpoint loads and in memory reports",
        lambda a: lambda: a.empty_cache(),
    ),
    # megatron binds Transformer Engine's / apex's CUDA-only optimizer kernels at import when
    # either is installed; on any other device its own host implementations must run instead.
    Patch(
        "megatron.core.optimizer:USING_PYTORCH_OPTIMIZER",
        "with TE installed, megatron builds TE's CUDA FusedAdam/FusedSGD; True selects torch's optimizers",
        lambda a: True,
    ),
    Patch(
        "megatron.core.optimizer:Adam",
        "the optimizer class megatron instantiates for 'adam' (TE's FusedAdam when TE is installed)",
        lambda a: torch.optim.AdamW,
    ),
    Patch(
        "megatron.core.optimizer:SGD",
        "the optimizer class megatron instantiates for 'sgd' (TE's FusedSGD when TE is installed)",
        lambda a: torch.optim.SGD,
    ),
    Patch(
        "megatron.core.optimizer.clip_grads:multi_tensor_applier",
        "gradient-norm clipping applies TE's CUDA multi-tensor kernels when TE is installed",
        lambda a: _megatron_util("local_multi_tensor_applier"),
    ),
    Patch(
        "megatron.core.optimizer.clip_grads:l2_norm_impl",
        "the gradient L2 norm kernel (TE's multi_tensor_l2norm when TE is installed); megatron's host "
        "fallback sums in fp32 and is inexact enough on large tensors for TP=2 to drift from one process",
        _exact_l2_norm_of,
    ),
    Patch(
        "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
        "the gradient scaling kernel used by clipping (TE's multi_tensor_scale when TE is installed)",
        lambda a: _megatron_util("local_multi_tensor_scale"),
    ),
    Patch(
        "megatron.core.optimizer.clip_grads:multi_tensor_scale_tensor_impl",
        "TE's tensor-scaled variant has no host implementation: None makes megatron scale by a float",
        lambda a: None,
    ),
    Patch(
        "megatron.core.optimizer.optimizer:multi_tensor_applier",
        "master-weight and grad copies in mixed-precision optimizers use TE's CUDA multi-tensor kernels",
        lambda a: _megatron_util("local_multi_tensor_applier"),
    ),
    Patch(
        "megatron.core.optimizer.optimizer:multi_tensor_scale_impl",
        "the copy/scale kernel of mixed-precision optimizers (TE's multi_tensor_scale when TE is installed)",
        lambda a: _megatron_util("local_multi_tensor_scale"),
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        "the MoE all-to-all dispatcher turns its split sizes into host numpy arrays only for CUDA "
        "tensors; elsewhere all_to_all_single receives tensors as split sizes and fails (EP > 1)",
        _host_copy_of,
    ),
    Patch(
        "megatron.core.tensor_parallel.random:_fork_rng",
        "activation recompute runs forwards during backward, outside the device-argument rewrite "
        "(e.g. the MoE router's .to(device=torch.cuda.current_device())); recomputation enters it again",
        _recompute_context_of,
    ),
    Patch(
        "torch.cuda:memory_allocated",
        "megatron's memory reports read CUDA allocator statistics",
        lambda a: lambda device=None: a.memory_stats().allocated,
    ),
    Patch(
        "torch.cuda:max_memory_allocated",
        "megatron's memory reports read the CUDA allocator's peak",
        lambda a: lambda device=None: a.memory_stats().peak_allocated,
    ),
    Patch(
        "megatron.core.tensor_parallel.layers:get_dummy_wgrad",
        "a linear with gradient_accumulation_fusion (parallel.wgrad_fusion) returns a placeholder wgrad "
        "from TE's get_dummy_wgrad, which allocates on CUDA; megatron's fallback without TE allocates on "
        "torch.cuda.current_device() during backward, where the device-argument rewrite is not active",
        _dummy_wgrad_of,
    ),
    Patch(
        "megatron.core.tensor_parallel.layers:HAVE_TE",
        "selects the get_dummy_wgrad path above whether TE is installed or not (otherwise it only "
        "guards CPU activation offloading, a CUDA feature)",
        lambda a: True,
    ),
    Patch(
        "megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda",
        "megatron's own linears (the output layer; every linear of the local backend) accumulate "
        "wgrad into main_grad (gradient_accumulation_fusion, parallel.wgrad_fusion) only through "
        "apex's fused_weight_gradient_mlp_cuda, bound at import where apex is installed: "
        "loong_xpu.wgrad supplies its two functions (TE's GEMM on CUDA, torch's addmm_ elsewhere)",
        _wgrad_kernels,
        on_cuda=True,
    ),
    Patch(
        "megatron.core.models.gpt.gpt_model:process_mtp_loss",
        "with context parallelism and per-token loss megatron weights each MTP layer's loss by the CP "
        "rank's own token counts (before / after the layer's shift), not the whole sequences': ranks "
        "weight their parts of one sequence differently and the gradient differs from one process's. "
        "loong_xpu.mtp_loss counts over the CP group (megatron's function otherwise)",
        _made_by("mtp_loss", "make_process_mtp_loss"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.transformer.multi_latent_attention:MLASelfAttention._qkv_down_projection",
        "MLA's RoPE key part (k_pe) is shared by all heads, but each TP rank expands it over its own "
        "heads: megatron sums its gradient over TP only for a duplicated down projection under "
        "sequence parallelism (megatron-core issue #1699). Without SP, or with the local backend's "
        "column-parallel down projection, every gradient below MLA differs from one process's. "
        "loong_xpu.mla_rope_key routes k_pe so that its gradient is all-reduced (or reduce-scattered)",
        _made_by("mla_rope_key", "make_qkv_down_projection"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.loong_drop_grad_accumulation_hooks",
        "megatron's DDP adds each gradient into main_grad from a Python hook per parameter and micro-batch "
        "(805 hook calls and add launches per step for the full Pi0.5, ~22 ms of host time), with no option "
        "to do without; this method (added) drops the hooked AccumulateGrad nodes DDP keeps in grad_accs, "
        "and loong_xpu.grad_hooks.flush_grads adds the gradients in one multi-tensor add per micro-batch "
        "(parallel.grad_accumulation=batched; bit for bit the hooks' sums)",
        _made_by("grad_hooks", "make_drop_grad_accumulation_hooks"),
        on_cuda=True,
    ),
    Patch(
        "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.scale_gradients",
        "with per-token losses every step divides the whole gradient buffer by the token count, a 0-dim "
        "device tensor, which TensorIterator multiplies in its unvectorised stride-0 kernel (5.5 ms a step "
        "for llama3.2-1b's bf16 buffer on an H100); loong_xpu.grad_scale does the same products in one "
        "multi-tensor kernel",
        _made_by("grad_scale", "make_scale_gradients"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.transformer.attention:apply_fused_qkv_rotary_pos_emb",
        "megatron's fused-QKV RoPE (model.fused_qkv_rope) is TE's kernel, ~1.2 TB/s on an H100 (16.4 ms of "
        "llama3.2-1b's 750 ms step at micro-batch 12); loong_xpu.qkv_rope sends the plain case to "
        "loong-kernels' TileLang kernel where it runs, TE's function otherwise",
        _made_by("qkv_rope", "make_fused_qkv_rope"),
        on_cuda=True,
    ),
    Patch(
        "megatron.core.optimizer.optimizer:ChainedOptimizer.get_grad_norm",
        "a NaN / Inf gradient makes megatron's global norm non-finite, yet its step updates anyway "
        "(grad_norm_skip_threshold compares with >, false for NaN): for a step armed by "
        "loong_xpu.nonfinite_step.step_unless_nonfinite the norm is read on the host as it is computed",
        _made_by("nonfinite_step", "make_get_grad_norm"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.optimizer.optimizer:ChainedOptimizer.step_with_ready_grads",
        "the update of a step armed by loong_xpu.nonfinite_step.step_unless_nonfinite runs only if that "
        "norm is finite: a non-finite step leaves weights and moments alone with no second pass over the "
        "gradients (megatron's own otherwise)",
        _made_by("nonfinite_step", "make_step_with_ready_grads"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.transformer.experimental_attention_variant.absorbed_mla:AbsorbedMLASelfAttention.__init__",
        "the same shared RoPE key in DeepSeek sparse attention's absorbed MLA, whose kv down projection is "
        "inlined in get_query_key_value_tensors: with the local backend's column-parallel projection under "
        "TP (+ SP, which AbsorbedMLA requires) k_pe's gradient is this rank's heads' share only. "
        "loong_xpu.mla_rope_key hooks the projection so that megatron reduce-scatters k_pe's gradient",
        _made_by("mla_rope_key", "make_absorbed_mla_init"),
        on_cuda=True,
    ),
    Patch(
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer._register_param_copy_back_gpu_hook",
        "with the optimizer offloaded to the host (optim.offload_fraction) megatron copies each updated fp32 master "
        "into its bf16 device weight from pageable memory with a dtype change: a new host tensor per step and a "
        "copy the host thread waits for, so the copies overlap nothing. loong_xpu.offload_copy_back pins the "
        "masters once and queues each copy asynchronously, cast on the device (the same rounding)",
        _made_by("offload_copy_back", "make_register_copy_back"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.build_cpu_optimizer_list",
        "megatron builds one host AdamW per offloaded tensor (528 on an EP=2 rank of qwen3-30b-a3b x 4 layers), and "
        "each step's Python, dispatch and hook overhead came to a third of the host update. loong_xpu.offload_buckets "
        "gives consecutive tensors of a group one host optimizer, up to 128 MiB of fp32 each: the same AdamW per tensor",
        _made_by("offload_buckets", "make_build_cpu_optimizer_list"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.step",
        "megatron updates the offloaded share with torch's CPU AdamW, which reads and writes 28 bytes a parameter in "
        "host memory: on a 4-GPU host the four processes' updates are bound by its bandwidth while the GPUs wait. "
        "loong_xpu.offload_device_update streams the pinned state through the GPU in chunks (copies on side streams) "
        "and updates it there with the CUDA build of the same fused AdamW, for optimizers marked by "
        "update_on_device (optim.offload_update=device); any other steps as megatron's",
        _made_by("offload_device_update", "make_step"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers",
        "with optim.offload_master=remainder the device update keeps the offloaded masters as their low 16 bits "
        "beside the bf16 weights, so megatron's fp32 host masters fall behind. megatron copies its state's masters "
        "into them here after a load: loong_xpu.offload_device_update writes them back first and reads the masters "
        "from the host on the next step",
        _made_by("offload_device_update", "make_sync_state"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.update_fp32_param_by_new_param",
        "megatron's reload_model_params copies the weights into the host masters here (train.init_from): with "
        "optim.offload_master=remainder the masters' low halves are then stale, so loong_xpu.offload_device_update "
        "reads the masters from the host on the next step",
        _made_by("offload_device_update", "make_reload_masters"),
        on_cuda=True,
        wraps=True,
    ),
    Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_main_param_and_optimizer_states",
        "every checkpoint format of megatron's distributed optimizer reads a parameter's master and moments here: "
        "with optim.offload_master=remainder loong_xpu.offload_device_update first writes back the host masters "
        "that are behind their low halves, so the checkpoint holds the exact fp32 masters",
        _made_by("offload_device_update", "make_read_param_state"),
        on_cuda=True,
        wraps=True,
    ),
)
"""Attribute patches. The device-argument rewrite (:class:`_DeviceRedirectMode`) is the one
patch that is not an attribute: it is a TorchFunctionMode, entered by :func:`redirect_cuda`
for ``device="cuda"`` / integer-ordinal arguments of factory functions, ``Tensor.to("cuda")``,
``Tensor.cuda()`` and therefore ``Module.cuda()``."""


def is_applied(target: str) -> bool:
    """Whether the manifest's patch of ``target`` is in place (a :class:`PatchSet` holds it)."""
    try:
        owner, attr = _resolve(target)
    except (ImportError, AttributeError):
        return False
    return hasattr(owner, f"_loong_original_{attr}")


def _resolve(target: str) -> tuple[object, str]:
    """``module:attr`` or ``module:Class.attr`` -> (the module or class, attr)."""
    module_name, path = target.split(":")
    *owners, attr = path.split(".")
    return functools.reduce(getattr, owners, importlib.import_module(module_name)), attr


@dataclass
class PatchSet:
    """The patches applied for one accelerator; :meth:`remove` restores the originals."""

    accelerator: Accelerator
    _undo: list[Callable[[], None]]
    applied: list[str]

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.applied.clear()


_ABSENT = object()  # the original of an attribute the module did not have


def _restore(owner: object, attr: str, marker: str) -> None:
    original = inspect.getattr_static(owner, marker)  # as stored: getattr would unwrap a staticmethod
    if original is _ABSENT:
        delattr(owner, attr)
    else:
        setattr(owner, attr, original)
    delattr(owner, marker)


def apply_patches(accel: Accelerator) -> PatchSet:
    """Apply every patch in :data:`MANIFEST`, then ``accel.extra_patches()``, plus the
    device-argument rewrite for ``accel``.

    On backends that run CUDA natively (``needs_cuda_redirect`` False) applies only the
    ``on_cuda`` patches.
    """
    patches = PatchSet(accel, [], [])
    try:
        _apply_all(accel, patches)
    except BaseException:
        patches.remove()  # never leave torch half-patched
        raise
    logger.debug("applied %d device patches for %s", len(patches.applied), accel.name)
    return patches


def _apply_all(accel: Accelerator, patches: PatchSet) -> None:
    undo, applied = patches._undo, patches.applied
    redirect = accel.needs_cuda_redirect
    for patch in (*MANIFEST, *accel.extra_patches()):  # the backend's own entries come last
        if not (redirect or patch.on_cuda):
            continue
        try:
            owner, attr = _resolve(patch.target)
        except ImportError:
            if patch.target.startswith("megatron."):
                continue  # loong-xpu works without megatron-core; its patches apply where it is installed
            raise
        except AttributeError as e:  # a class the target names is gone
            raise RuntimeError(f"loong_xpu patch {patch.target}: {e} (the installed version changed it)") from None
        marker = f"_loong_original_{attr}"  # holds the original; its presence means "patched"
        if hasattr(owner, marker):
            if patch.on_cuda:  # an enclosing PatchSet supplies it (e.g. a host template built
                continue  # during a CUDA run): the same replacement on every backend
            raise RuntimeError(f"{patch.target} is already patched: remove the other PatchSet first")
        # the attribute as stored, so that a staticmethod is restored as one (getattr unwraps it)
        original = inspect.getattr_static(owner, attr, _ABSENT)
        # (a method gone from the class may leave its abstract base's in view)
        if patch.wraps and (original is _ABSENT or getattr(original, "__isabstractmethod__", False)):
            raise RuntimeError(f"loong_xpu patch {patch.target}: {attr} is gone from {getattr(owner, '__name__', owner)} "
                               "(the installed version changed what this patch wraps)")  # fmt: skip
        replacement = patch.make(accel)
        if isinstance(replacement, types.FunctionType) and replacement.__module__ == __name__:
            # only our own closures take the original's name and doc; never mutate megatron's functions
            replacement = functools.wraps(original)(replacement)
        setattr(owner, marker, original)
        setattr(owner, attr, replacement)
        undo.append(functools.partial(_restore, owner, attr, marker))
        applied.append(patch.target)
    if not redirect:
        return
    mode = _DeviceRedirectMode(accel)
    mode.__enter__()
    undo.insert(0, lambda: mode.__exit__(None, None, None))  # undone last, after the attributes
    applied.append("device-argument rewrite (TorchFunctionMode)")


@contextlib.contextmanager
def redirect_cuda(accel: Accelerator) -> Iterator[PatchSet]:
    """Context manager form of :func:`apply_patches`."""
    patches = apply_patches(accel)
    try:
        yield patches
    finally:
        patches.remove()
