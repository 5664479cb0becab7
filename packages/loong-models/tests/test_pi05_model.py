"""Pi0.5's structure: parameter counts without building, the prefix never seeing the actions, the
flow-matching pieces, and config errors that name the key."""

import dataclasses

import pytest
import torch

from loong_models import load_model_config
from loong_models.embodied import Pi05Policy
from loong_models.embodied.pi05 import attention_mask, sample_time
from loong_models.embodied.pi05.layers import attention
from loong_models.embodied.pi05.model import COMPILERS, real_dims

TINY = load_model_config("pi05-tiny").embodied


def test_parameter_counts_match_what_gets_built_tiny_and_full_shape():
    assert TINY.num_parameters() == sum(p.numel() for p in Pi05Policy(TINY).parameters())
    full = load_model_config("pi05")
    with torch.device("meta"):
        built = sum(p.numel() for p in Pi05Policy(full.embodied).parameters())
    assert full.num_parameters() == built == 3_353_433_872


def test_prefix_attends_bidirectionally_and_never_to_the_actions():
    pad = torch.tensor([[True, True, False, True, True]])
    starts = torch.tensor([[False, False, False, True, False]])  # prefix of 3 (one padded), 2 actions
    m = attention_mask(pad, starts)[0]
    assert m[0, 1] and m[1, 0]  # prefix <-> prefix
    assert not m[0, 3] and not m[1, 4]  # prefix -/-> actions
    assert m[3, 0] and m[4, 3] and m[3, 4]  # actions -> prefix and each other
    assert not m[:, 2].any() and not m[2].any()  # the padded token is invisible and sees nothing


def test_training_times_follow_the_squeezed_beta():
    t = sample_time(TINY, 20000, torch.Generator().manual_seed(0))
    assert t.min() >= 0.001 and t.max() <= 1.0
    assert t.mean().item() == pytest.approx(0.001 + 0.999 * 1.5 / 2.5, abs=0.01)  # Beta(1.5, 1) mean 0.6


def test_a_sample_draws_the_same_noise_whatever_batch_holds_it():
    policy = Pi05Policy(TINY)
    actions = torch.zeros(3, TINY.chunk_size, TINY.max_action_dim)
    n3, t3 = policy.draw_noise_and_time({"actions": actions, "sample_ids": torch.tensor([5, 6, 7])})
    n1, t1 = policy.draw_noise_and_time({"actions": actions[:1], "sample_ids": torch.tensor([6])})
    assert torch.equal(n3[1], n1[0]) and torch.equal(t3[1], t1[0])


def test_config_errors_name_the_key():
    with pytest.raises(
        ValueError, match="model.embodied.expert.head_dim=32 must equal model.embodied.vlm.head_dim=16"
    ):
        load_model_config("pi05-tiny", ["embodied.expert.head_dim=32"])
    with pytest.raises(ValueError, match="model.embodied.compile_scope='all'; allowed: none, per_layer, policy"):
        load_model_config("pi05-tiny", ["embodied.compile_scope=all"])
    with pytest.raises(ValueError, match="model.embodied.compile_mode='graphs'; allowed: default, reduce-overhead, "):
        load_model_config("pi05-tiny", ["embodied.compile_mode=graphs"])
    with pytest.raises(ValueError, match="model.embodied.attention_impl='flash'; allowed: sdpa, eager"):
        load_model_config("pi05-tiny", ["embodied.attention_impl=flash"])


def test_eager_attention_equals_sdpa_with_shared_kv_heads_and_a_padded_query_row():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 7, 16, generator=g) for n in (8, 2, 2))  # 4 query heads per KV head
    mask = torch.rand(2, 7, 7, generator=g) > 0.3
    mask[:, :, 0] = True
    mask[1, 3] = False  # a padded query: sees nothing, averages
    expect = attention(q, k, v, mask, "sdpa")
    torch.testing.assert_close(attention(q, k, v, mask, "eager"), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compile_scope", ["per_layer", "policy"])
def test_a_policy_with_eager_attention_and_compiled_layers_trains_like_the_eager_sdpa_policy(compile_scope):
    batch = {"images": torch.rand(2, 1, 3, 64, 64) * 2 - 1, "image_masks": torch.ones(2, 1, dtype=torch.bool),
             "tokens": torch.randint(0, 100, (2, 12)), "token_mask": torch.arange(12).expand(2, -1) < torch.tensor([[12], [7]]),
             "actions": torch.randn(2, TINY.chunk_size, TINY.max_action_dim)}  # fmt: skip
    noise, time = torch.randn_like(batch["actions"]), torch.tensor([0.3, 0.9])
    torch.manual_seed(0)
    ref = Pi05Policy(TINY)
    fast = Pi05Policy(dataclasses.replace(TINY, attention_impl="eager"))
    fast.load_state_dict(ref.state_dict())
    # the compile_scope's code path; aot_eager traces (dynamo) and splits forward/backward
    # (AOT autograd) as inductor does, without the minutes of C++ code generation on a CPU
    getattr(fast, COMPILERS[compile_scope])(backend="aot_eager")
    assert fast.state_dict().keys() == ref.state_dict().keys()
    losses = [p.flow_loss(batch, noise, time).mean() for p in (ref, fast)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    scale = max(p.grad.abs().max() for p in ref.parameters() if p.grad is not None)
    for (name, a), b in zip(ref.named_parameters(), fast.parameters()):
        # an unused output's parameter: no gradient in eager mode, zero when compiled (or neither)
        expect, got = (torch.zeros_like(a) if p.grad is None else p.grad for p in (a, b))
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("mask", [[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
def test_the_real_action_dims_are_those_of_the_mask_whether_a_prefix_or_not(mask):
    losses = torch.randn(2, 3, 5)
    dims = torch.tensor(mask, dtype=torch.bool)
    got = real_dims(losses, dims)
    assert torch.equal(got, losses[..., dims]) and got.is_contiguous()
