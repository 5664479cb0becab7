"""Wan DiT in loong-models: zoo sizes equal the released transformers (diffusers built on the meta
device), config errors name the key, the flow-matching objective is Wan's (DiffSynth's formulas,
diffusers' FlowMatchEulerDiscreteScheduler sigmas) and reproducible per sample, the Euler sampler
inverts the flow, and a tiny Wan trains a step on the local backend."""

from __future__ import annotations

import math

import pytest
import torch

from loong_models import ModelConfig, build_model, build_transformer_config, load_model_config
from loong_models.diffusion import FlowMatching, FlowMatchingConfig, WanConfig, euler_sample

diffusers = pytest.importorskip("diffusers")

RELEASED = {  # diffusers WanTransformer3DModel config of each release (transformer/config.json)
    "wan2.1-1.3b": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "wan2.1-14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "wan2.2-5b": dict(num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48),
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_zoo_wan_parameter_count_equals_the_released_transformer(name):
    with torch.device("meta"):
        ref = diffusers.WanTransformer3DModel(attention_head_dim=128, text_dim=4096, **RELEASED[name])
    assert load_model_config(name).num_parameters() == sum(p.numel() for p in ref.parameters())


def test_released_counts_are_the_published_sizes():
    counts = {n: load_model_config(n).num_parameters() for n in RELEASED}
    assert counts == {"wan2.1-1.3b": 1_418_996_800, "wan2.1-14b": 14_288_491_584, "wan2.2-5b": 4_999_787_712}
    i2v = WanConfig(num_layers=40, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, in_channels=36,
                    image_dim=1280)  # fmt: skip
    with torch.device("meta"):
        ref = diffusers.WanTransformer3DModel(num_layers=40, num_attention_heads=40, attention_head_dim=128,
                                              ffn_dim=13824, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)  # fmt: skip
    assert i2v.num_parameters() == sum(p.numel() for p in ref.parameters())  # Wan2.1-I2V-14B


def test_wan_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"model.diffusion.attention_head_dim=9 does not split"):
        load_model_config("wan-tiny", ["diffusion.attention_head_dim=9"])
    with pytest.raises(ValueError, match=r"model.vae.z_dim=4 != model.diffusion.out_channels=8"):
        load_model_config("wan-tiny", ["diffusion.out_channels=8"])


def _diffsynth_reference(n: int, shift: float):
    """DiffSynth's FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True) in training mode."""
    sigmas = torch.linspace(1.0, 0.0, n + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    t = sigmas * n
    y = torch.exp(-2 * ((t - n / 2) / n) ** 2)
    w = (y - y.min()) * (n / (y - y.min()).sum())
    return sigmas, t, w


def test_flow_matching_is_wans_objective():
    fm = FlowMatching(FlowMatchingConfig())
    sigmas, t, w = _diffsynth_reference(1000, 5.0)
    ref = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    assert torch.allclose(fm.sigmas.float(), sigmas, atol=1e-6)
    assert torch.allclose(fm.sigmas.float(), ref.sigmas[:1000].float(), atol=1e-6)
    assert torch.allclose(fm.weights.float(), w, atol=1e-5)  # DiffSynth computes in fp32, Loong in fp64
    x0 = torch.randn(3, 4, 1, 8, 8)
    batch = fm.prepare(x0, [7, 8, 9], seed=1)
    for i, sid in enumerate([7, 8, 9]):
        k, eps = fm.draw(sid, 1, x0.shape[1:])
        s = float(sigmas[k])
        assert torch.allclose(batch.noisy[i], (1 - s) * x0[i] + s * eps, atol=1e-6)
        assert torch.allclose(batch.noisy[i], ref.scale_noise(x0[i : i + 1], ref.timesteps[k : k + 1], eps[None])[0], atol=1e-5)
        assert torch.allclose(batch.target[i], eps - x0[i])
        assert math.isclose(float(batch.timestep[i]), float(t[k]), rel_tol=1e-6)
        assert math.isclose(float(batch.weight[i]), float(w[k]), abs_tol=1e-5)
    pred = torch.randn_like(x0)
    want = torch.stack([torch.nn.functional.mse_loss(pred[i], batch.target[i]) * batch.weight[i] for i in range(3)])
    assert torch.allclose(fm.per_sample_loss(pred, batch), want, rtol=1e-5)


def test_noise_depends_only_on_seed_and_sample_id():
    fm = FlowMatching(FlowMatchingConfig(min_boundary=0.358))
    x0 = torch.zeros(4, 2, 1, 4, 4)
    a, b = fm.prepare(x0, [0, 1, 2, 3], seed=5), fm.prepare(x0[2:], [2, 3], seed=5)
    assert torch.equal(a.noisy[2:], b.noisy) and torch.equal(a.timestep[2:], b.timestep)
    assert not torch.equal(a.noisy[0], a.noisy[1])
    assert not torch.equal(fm.prepare(x0, [0], seed=6).noisy[0], a.noisy[0])
    assert (a.timestep <= fm.timesteps[358]).all()  # Wan2.2's low-noise expert range


def test_euler_sampler_inverts_the_flow_with_the_true_velocity():
    x0, eps = torch.randn(2, 4, 1, 6, 6), torch.randn(2, 4, 1, 6, 6)
    out = euler_sample(lambda x, t: eps - x0, eps, steps=7)
    assert torch.allclose(out, x0, atol=1e-5)


def test_tiny_wan_trains_a_step_on_the_local_backend(megatron_cpu):
    cfg = load_model_config("wan-tiny")
    assert isinstance(cfg, ModelConfig) and cfg.is_diffusion
    base = build_transformer_config(cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32)
    model = build_model(cfg, base, device_type="cpu")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    fm = FlowMatching(FlowMatchingConfig())
    x0, ctx = torch.randn(2, 4, 1, 8, 8), torch.randn(2, 32, 32)
    batch = fm.prepare(x0, [0, 1], seed=0)
    loss = fm.per_sample_loss(model(batch.noisy, batch.timestep, ctx), batch).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def _loss_and_grads(megatron_cpu, overrides: list[str]) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = load_model_config("wan-tiny", ["diffusion.num_layers=3", *overrides])
    base = build_transformer_config(cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32)
    torch.manual_seed(0)
    model = build_model(cfg, base, device_type="cpu").train()
    fm = FlowMatching(FlowMatchingConfig())
    g = torch.Generator().manual_seed(1)
    x0, ctx = torch.randn(2, 4, 2, 8, 8, generator=g), torch.randn(2, 32, 32, generator=g)
    batch = fm.prepare(x0, [0, 1], seed=0)
    loss = fm.per_sample_loss(model(batch.noisy, batch.timestep, ctx), batch).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_every_recompute_mode_gives_the_same_loss_and_gradients(megatron_cpu):
    loss, grads = _loss_and_grads(megatron_cpu, [])
    for over in (["diffusion.recompute=full"], ["diffusion.recompute=keep_attention"],
                 ["diffusion.recompute=keep_attention", "diffusion.recompute_num_layers=2"],
                 ["diffusion.recompute=full", "diffusion.recompute_num_layers=1"]):  # fmt: skip
        got_loss, got = _loss_and_grads(megatron_cpu, over)
        assert got_loss == loss, over  # the same forward; grads sum in another order (shared timestep path)
        assert all(torch.allclose(got[n], grads[n], rtol=1e-5, atol=1e-7) for n in grads), over


def test_recompute_num_layers_is_checked_against_the_layers_and_the_mode():
    with pytest.raises(ValueError, match=r"model.diffusion.recompute_num_layers=3 must be null or in \[0, num_layers=2\]"):
        load_model_config("wan-tiny", ["diffusion.recompute=full", "diffusion.recompute_num_layers=3"])
    with pytest.raises(ValueError, match=r"model.diffusion.recompute_num_layers=1 .* set \(it is None\)"):
        load_model_config("wan-tiny", ["diffusion.recompute_num_layers=1"])


def test_fused_pointwise_kernels_give_the_eager_loss_and_gradients(megatron_cpu):
    """diffusion.fuse_pointwise=true (torch.compile; inductor's C++ kernels on the CPU, Triton on
    CUDA) computes what the eager fp32 chains do, with recompute too."""
    loss, grads = _loss_and_grads(megatron_cpu, [])
    got_loss, got = _loss_and_grads(megatron_cpu, ["diffusion.fuse_pointwise=true", "diffusion.recompute=keep_attention"])
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert all(torch.allclose(got[n], grads[n], rtol=1e-5, atol=1e-6) for n in grads)


def test_patch_tokens_invert_unpatchify_and_cp_parts_cover_each_token_once():
    from loong_models.diffusion.tokens import context_parallel_part, patch_tokens, unpatchify

    video = torch.randn(2, 3, 4, 6, 8)
    tokens = patch_tokens(video, (2, 2, 2))
    assert tokens.shape == (2, 2 * 3 * 4, 8 * 3)
    assert torch.equal(unpatchify(tokens, (2, 2, 2), (2, 3, 4)), video)
    assert torch.equal(tokens[:, 0, :3], video[:, :, 0, 0, 0])  # token 0, patch element 0: channels last
    parts = [context_parallel_part(24, 3, r, multiple=2) for r in range(3)]
    assert [i for p in parts for i in range(24)[p]] == list(range(24))
    with pytest.raises(ValueError, match=r"parallel.cp=4 x parallel.tp=4 \(sequence parallel\): a sample's 24 latent"):
        context_parallel_part(24, 4, 0, multiple=4)


def test_the_loss_shares_of_a_samples_token_parts_add_up_to_its_weighted_mse():
    from loong_models.diffusion.tokens import context_parallel_part, patch_tokens

    fm = FlowMatching(FlowMatchingConfig())
    batch = fm.prepare(torch.randn(2, 4, 2, 4, 4), [3, 4], seed=0)
    pred = torch.randn_like(batch.target)
    whole = fm.per_sample_loss(pred, batch)
    p, t = patch_tokens(pred, (1, 2, 2)), patch_tokens(batch.target, (1, 2, 2))
    parts = [context_parallel_part(t.shape[1], 4, r) for r in range(4)]
    shares = sum(fm.per_sample_loss(p[:, part], batch, target=t[:, part]) for part in parts)
    assert torch.allclose(shares, whole, rtol=1e-6)
