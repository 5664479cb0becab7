"""An fp32 master weight held as its bf16 weight plus the master's 16 low bits.

Transformer Engine's FusedAdam keeps the master weights this way (``store_param_remainders``, on
in megatron's precision-aware optimizer): the bf16 weight is the master's high half rounded to
nearest with ties away from zero, and an int16 holds the low half. The pair gives the master back
bit for bit: a low half of 0x8000 or more (a negative int16) rounded the high half up, so one is
taken off again. Rounding to nearest *even* instead could not be undone from 16 bits: a low half
of exactly 0x8000 rounds up or down depending on the high half's last bit.

Both functions work in place on int32 views, so they allocate nothing on the device.
"""

from __future__ import annotations

import torch


def join_master(weight: torch.Tensor, remainder: torch.Tensor, master: torch.Tensor) -> None:
    """Writes into ``master`` (fp32) the master that ``weight`` (bf16) and ``remainder`` (int16,
    the low 16 bits) hold. All three on one device and of one shape."""
    bits = master.view(torch.int32)
    bits.copy_(weight.view(torch.int16))  # sign-extended: the high half in the low 16 bits of an int32
    bits.bitwise_left_shift_(16)
    # + the low half read as a signed int16: where it is negative (>= 0x8000) that also takes one
    # off the high half, undoing the rounding up
    bits.add_(remainder)


def split_master_(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """Writes ``master`` (fp32) into ``weight`` (bf16, rounded to nearest, ties away from zero)
    and ``remainder`` (int16, its low 16 bits). Overwrites ``master`` on the way."""
    bits = master.view(torch.int32)
    remainder.copy_(bits)  # the low 16 bits, read as signed
    bits.sub_(remainder)  # the high half, plus one where the low half is >= 0x8000, times 2^16
    bits.bitwise_right_shift_(16)
    weight.view(torch.int16).copy_(bits)
