"""The vendor collective backend ``fakebkcl``: registered with torch.distributed by name, backed
by gloo. A real Kunlun package registers BKCL here (or imports the vendor's torch extension,
which does so); every process group Loong and megatron-core create then carries this name."""

from __future__ import annotations

import torch.distributed as dist

BACKEND_NAME = "fakebkcl"


def _create_backend(opts, backend_options) -> dist.ProcessGroup:
    # extended_api: opts carries the store, this rank in the group, the group size and the timeout.
    return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def register_collective_backend() -> None:
    """Register ``fakebkcl`` with torch.distributed once per process (torch's registry is global)."""
    if BACKEND_NAME.upper() in dist.Backend.backend_type_map or BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])
