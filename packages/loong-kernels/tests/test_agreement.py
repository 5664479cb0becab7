"""loong_kernels.agreement: the checks a candidate kernel must pass before its time counts."""

import torch

from loong_kernels.agreement import rel_diff, summed_rel_diff


def _bf16_sum_over_chunks(dlogits: torch.Tensor, h: torch.Tensor, chunk: int) -> torch.Tensor:
    """dW = dlogits^T h accumulated in bf16 chunk by chunk, as the chunked losses do."""
    dw = torch.zeros(dlogits.shape[1], h.shape[1], dtype=torch.bfloat16)
    for s in range(0, h.shape[0], chunk):
        dw += (dlogits[s : s + chunk].float().t() @ h[s : s + chunk].float()).bfloat16()
    return dw


def test_two_chunkings_of_a_bf16_sum_agree_and_a_lost_chunk_or_a_wrong_entry_does_not():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4096, 64, generator=g).bfloat16()
    dlogits = (torch.randn(4096, 300, generator=g) * 1e-2).bfloat16()
    fine, coarse = _bf16_sum_over_chunks(dlogits, h, 64), _bf16_sum_over_chunks(dlogits, h, 1024)
    exact = dlogits.float().t() @ h.float()
    assert summed_rel_diff([fine], [coarse]) < 2e-2
    assert summed_rel_diff([coarse], [exact]) < 2e-2
    assert rel_diff([fine], [coarse]) > summed_rel_diff([fine], [coarse])  # single entries move the most
    lost_chunk = _bf16_sum_over_chunks(dlogits[:-1024], h[:-1024], 1024)
    assert summed_rel_diff([lost_chunk], [coarse]) > 0.1
    wrong_entry = coarse.clone()
    wrong_entry[7, 3] = coarse.float().abs().max() * 0.5
    assert summed_rel_diff([wrong_entry], [coarse]) > 0.1
    assert summed_rel_diff([coarse, wrong_entry], [coarse, coarse]) > 0.1  # the worst tensor counts
