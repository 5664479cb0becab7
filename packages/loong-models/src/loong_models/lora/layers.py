"""LoRA on megatron's tensor-parallel linears, applied from outside the model.

``apply_lora(modules, cfg)`` turns every matching linear into a LoRA linear in place: the module
keeps its class's behaviour and parameter names (``weight``, ``bias``) and gains two adapter
parameters, ``lora_a`` [rank, in] and ``lora_b`` [out, rank], with

    y = base(x) + (alpha / rank) * dropout(x) @ lora_a.T @ lora_b.T

``lora_b`` starts at zero, so the model is unchanged until the adapters train. The base weights
of the adapted components are frozen.

Tensor parallelism follows the base layer's split, so no rank ever holds a full-size tensor:

* column-parallel base (Q/K/V, fc1): ``lora_a`` is replicated, ``lora_b`` holds this rank's output
  rows. The rank-r activation ``x @ A.T`` is the same on every rank; its gradient is the sum of
  every rank's partial one (copy-to-TP region: identity forward, all-reduce backward). Under
  sequence parallelism x is this rank's sequence slice: the rank-r activation is all-gathered
  along the sequence instead (reduce-scatter backward), and ``lora_a``'s gradient, partial over
  the sequence, is summed over TP by megatron's finalize_model_grads (``sequence_parallel``).
* row-parallel base (attention out, fc2): ``lora_a`` holds this rank's input columns,
  ``lora_b`` is replicated; the partial rank-r products are all-reduced (reduce-scattered along
  the sequence under SP, ``lora_b`` then marked ``sequence_parallel``) exactly as the base
  reduces its output, then multiplied by ``lora_b``.

Only rank-r tensors cross the TP group. Checkpoints store the adapters in the global layout of
their base weight (``lora_b`` of a SwiGLU fc1 split into gate and up halves like the weight), so
a checkpoint saved under one TP layout loads under another, and merging is ``W + s * B @ A`` on
global tensors.

Transformer Engine's ``TELayerNormColumnParallelLinear`` normalises its input itself: the
adapter must see the normalised input, which TE returns when ``return_layernorm_output`` is set
(TE adds that output's gradient back before its norm backward).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterator
from fnmatch import fnmatch

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from loong_models.lora.config import LoraConfig

ADAPTER_PARAMS = ("lora_a", "lora_b")


class LoraError(ValueError):
    """A LoRA config that cannot be applied to this model; the message names the key."""


def is_adapter_key(key: str) -> bool:
    """Whether a parameter / checkpoint key names a LoRA adapter tensor."""
    return key.rsplit(".", 1)[-1] in ADAPTER_PARAMS


class _LoraMixin:
    """Put before a megatron linear class in the MRO; the linear's forward / sharded_state_dict
    stay the base's, with the adapter added. Attributes are set by :func:`_convert`."""

    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    lora_mode: str  # "column" | "row"
    lora_scale: float
    lora_dropout: float
    lora_glu: bool  # lora_b's rows are [gate; up] halves (SwiGLU fc1): checkpointed like the weight
    lora_sp: bool  # sequence parallel: the adapter input is this rank's sequence slice
    lora_tp_group: object  # the base layer's TP group (a VLM encoder may have its own TP size)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = super().forward(x, *args, **kwargs)
        return out + self.lora_delta(x), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        group = self.lora_tp_group
        x = self._lora_input_dropout(x)
        h = F.linear(x, self.lora_a)
        if self.lora_mode == "column":
            h = gather_from_sequence_parallel_region(h, group=group) if self.lora_sp else \
                copy_to_tensor_model_parallel_region(h, group=group)  # fmt: skip
        else:
            h = reduce_scatter_to_sequence_parallel_region(h, group=group) if self.lora_sp else \
                reduce_from_tensor_model_parallel_region(h, group=group)  # fmt: skip
        return F.linear(h, self.lora_b) * self.lora_scale

    def _lora_input_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.lora_dropout):
            return x
        if self.lora_mode == "row" or self.lora_sp:
            # x differs across TP ranks (input columns or sequence slices): TP-rank-specific RNG
            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.lora_dropout)
        return F.dropout(x, self.lora_dropout)  # replicated input: the same mask on every TP rank

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        # The base wraps every tensor of its state dict, the adapters as replicated ones: replace
        # those with entries split like the base weight.
        axis = {"lora_b": 0} if self.lora_mode == "column" else {"lora_a": 1}
        adapters = make_sharded_tensors_for_checkpoint(
            {"lora_a": self.lora_a, "lora_b": self.lora_b}, prefix, axis, sharded_offsets,
            tp_group=self.lora_tp_group, dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip
        if self.lora_glu:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_b"
            adapters[key] = apply_swiglu_sharded_factory(
                adapters[key], sharded_offsets, metadata.get("singleton_local_shards", False),
                tp_group=self.lora_tp_group, dp_group=metadata["dp_cp_group"],
            )  # fmt: skip
        sd.update(adapters)
        return sd


class _LoraLayerNormMixin(_LoraMixin):
    """For TE's fused norm + column linear: the adapter reads the normalised input."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        res = super(_LoraMixin, self).forward(x, *args, **kwargs)
        # megatron's wrapper passes TE's (out, bias, ln_out) through when TE returns the bias,
        # else wraps TE's (out, ln_out) as ((out, ln_out), None)
        if self.te_return_bias:
            out, bias, ln_out = res
        else:
            (out, ln_out), bias = res
        return out + self.lora_delta(ln_out), bias


def _supported() -> dict[type, tuple[str, type]]:
    """Base class -> (parallel mode, mixin); TE's classes only where TE imports."""
    table: dict[type, tuple[str, type]] = {ColumnParallelLinear: ("column", _LoraMixin),
                                           RowParallelLinear: ("row", _LoraMixin)}  # fmt: skip
    try:
        from megatron.core.extensions.transformer_engine import (
            HAVE_TE,
            TEColumnParallelLinear,
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )
    except Exception:  # TE absent or unusable without CUDA: local modules only
        return table
    if HAVE_TE:
        table.update({TEColumnParallelLinear: ("column", _LoraMixin), TERowParallelLinear: ("row", _LoraMixin),
                      TELayerNormColumnParallelLinear: ("column", _LoraLayerNormMixin)})  # fmt: skip
    return table


@functools.cache
def _lora_class(base: type, mixin: type) -> type:
    return type(f"Lora{base.__name__}", (mixin, base), {"__module__": __name__})


def _in_layer(model: torch.nn.Module, path: str) -> tuple[int, str] | None:
    """(global 1-based number of the transformer layer holding module ``path``, path inside it)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        number = getattr(model.get_submodule(".".join(parts[:i])), "layer_number", None)
        if isinstance(number, int):
            return number, ".".join(parts[i:])
    return None


def _iter_targets(model: torch.nn.Module, patterns: list[str]) -> Iterator[tuple[str, torch.nn.Module]]:
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if path and any(fnmatch(leaf, p) or fnmatch(path, p) for p in patterns):
            yield path, module


def apply_lora(
    components: dict[str, torch.nn.Module | None], cfg: LoraConfig, *, prefix: str = "model.lora"
) -> int:
    """Freeze the base weights of ``components`` named in ``cfg.components`` and add adapters to
    their linears matching ``cfg.targets``. Returns the number of adapted linears.

    ``components`` maps the model's component names (``foundation``, ``image_encoder``, ...) to
    this rank's module of each, None for a component that is not on this pipeline stage.
    Adapter initialisation depends only on ``torch.initial_seed()``, the
    component, the global layer number and the module's path in the layer, so every TP / PP
    layout starts from the same adapters."""
    cfg.validate(prefix)
    table = _supported()
    count, present = 0, False
    for comp in cfg.components:
        if comp not in components:
            raise LoraError(f"{prefix}.components: {comp!r} is not a component of this model "
                            f"(it has: {', '.join(components)})")  # fmt: skip
        model = components[comp]
        if model is None:
            continue
        present = True
        for p in model.parameters():
            p.requires_grad_(False)
        for path, module in list(_iter_targets(model, cfg.targets)):
            if isinstance(module, _LoraMixin):
                continue
            entry = table.get(type(module))
            if entry is None:
                if isinstance(getattr(module, "weight", None), torch.Tensor):
                    raise LoraError(
                        f"{prefix}.targets: {comp}.{path} is a {type(module).__name__}; LoRA supports "
                        f"{', '.join(sorted(c.__name__ for c in table))}"
                    )
                continue  # a container whose name matched (e.g. a block): its linears match by name
            where = _in_layer(model, path)
            if where is None:
                raise LoraError(f"{prefix}.targets: {comp}.{path} is not inside a transformer layer; "
                                "LoRA adapts the linears of transformer layers only")  # fmt: skip
            _convert(
                module, *entry, cfg, key=f"{comp}/{where[0]}/{where[1]}", glu=path.endswith("linear_fc1")
            )
            count += 1
    if present and count == 0:
        raise LoraError(f"{prefix}.targets={cfg.targets} match no linear layer in {cfg.components}")
    return count


def _tp_group(module):
    """The TP group the base layer splits over: its own (local: ``tp_group``, TE: ``_tp_group``)."""
    group = getattr(module, "tp_group", None) or getattr(module, "_tp_group", None)
    return group if group is not None else mpu.get_tensor_model_parallel_group()


def _convert(module, mode: str, mixin: type, cfg: LoraConfig, *, key: str, glu: bool) -> None:
    if getattr(module, "gather_output", False):
        raise LoraError(f"LoRA on {key}: column-parallel linears with gather_output are not supported")
    if getattr(module, "is_expert", False):
        raise LoraError(f"LoRA on {key}: expert (MoE) linears are not supported")
    group = _tp_group(module)
    tp_size, tp_rank = group.size(), group.rank()
    weight = module.weight
    out_local, in_local = weight.shape
    in_full = in_local * tp_size if mode == "row" else in_local
    # kaiming-uniform(a=sqrt(5)) of the full A, as nn.Linear / PEFT: bound 1/sqrt(fan_in)
    gen = torch.Generator().manual_seed((torch.initial_seed() + zlib.crc32(key.encode())) % 2**63)
    bound = 1.0 / math.sqrt(in_full)
    a_full = torch.empty(cfg.rank, in_full).uniform_(-bound, bound, generator=gen)
    if mode == "row":
        a_full = a_full[:, tp_rank * in_local : (tp_rank + 1) * in_local]
    a = torch.nn.Parameter(a_full.to(device=weight.device, dtype=weight.dtype).contiguous())
    b = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, device=weight.device, dtype=weight.dtype))
    sp = bool(module.config.sequence_parallel) and tp_size > 1
    split, replicated = (b, a) if mode == "column" else (a, b)
    set_tensor_model_parallel_attributes(split, True, 0 if mode == "column" else 1, 1)
    for p in (a, b):
        p.allreduce = True  # reduced over DP like every dense weight
    if sp:
        replicated.sequence_parallel = True  # gradient is partial over the sequence: summed over TP
    if getattr(weight, "average_gradients_across_tp_domain", False):
        # a component replicated over the foundation's TP group (VLM encoder with a smaller TP):
        # its adapters are replicated the same way and tagged like its weights
        for p in (a, b):
            p.average_gradients_across_tp_domain, p.tensor_model_parallel = True, False
    module.__class__ = _lora_class(type(module), mixin)
    module.register_parameter("lora_a", a)
    module.register_parameter("lora_b", b)
    module.lora_mode, module.lora_scale, module.lora_dropout = mode, cfg.scale, cfg.dropout
    module.lora_glu = glu and bool(module.config.gated_linear_unit)
    module.lora_sp = sp
    module.lora_tp_group = group
    if mixin is _LoraLayerNormMixin:
        module.return_layernorm_output = True
        module.return_layernorm_output_gathered = False


def lora_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The adapter parameters of ``model`` with their names."""
    return ((n, p) for n, p in model.named_parameters() if is_adapter_key(n))
