"""Process groups for a model component whose tensor-parallel size differs from the foundation's
(a VLM's image encoder at TP=1 inside a foundation at TP=2, ...).

The component's TP groups split every megatron TP group into consecutive blocks of the
component's size; every other group (PP, DP, CP, ...) is megatron's own, so the component sits
in the same data-parallel replica as the rest of its rank's model.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.process_groups_config import ProcessGroupCollection


def component_process_groups(tensor_model_parallel_size: int) -> ProcessGroupCollection:
    """megatron's process groups with ``tp`` (and ``tp_cp``) replaced by the component's TP group.

    Collective: every rank calls it, with the same size. The size must divide megatron's TP size.
    Needs ``mpu.initialize_model_parallel`` first.
    """
    ftp = mpu.get_tensor_model_parallel_world_size()
    if tensor_model_parallel_size < 1 or ftp % tensor_model_parallel_size:
        raise ValueError(f"component tensor_model_parallel_size={tensor_model_parallel_size} must divide the "
                         f"foundation's tensor-parallel size {ftp}")  # fmt: skip
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    if tensor_model_parallel_size == ftp:
        return pgs
    if mpu.get_context_parallel_world_size() != 1:
        raise ValueError(
            "a component TP size different from the foundation's is not supported with context parallelism"
        )
    # Every rank needs every TP group's ranks to create the sub-groups collectively.
    world = dist.get_world_size()
    tp_groups: list[list[int]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(
        tp_groups, list(dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()))
    )
    blocks, seen = [], set()
    for ranks in tp_groups:
        key = tuple(ranks)
        if key in seen:
            continue
        seen.add(key)
        blocks += [
            ranks[i : i + tensor_model_parallel_size]
            for i in range(0, len(ranks), tensor_model_parallel_size)
        ]
    group, _ = dist.new_subgroups_by_enumeration(blocks)
    pgs.tp = group
    pgs.tp_cp = group
    return pgs


def image_encoder_process_groups(model, foundation_tp: int) -> ProcessGroupCollection | None:
    """A VLM's image-encoder groups when its TP size (``model.image_encoder.
    tensor_model_parallel_size``) differs from the foundation's, else None (megatron's own).
    ``model``: a ``loong_models.ModelConfig``. Collective when the sizes differ."""
    from loong_models import encoder_tensor_parallel_size

    if model.image_encoder is None:
        return None
    etp = encoder_tensor_parallel_size(model, foundation_tp)
    return component_process_groups(etp) if etp != foundation_tp else None
