"""Pi0.5 parity with LeRobot's PI05 (the transcribed reference on transformers' modules) through
the declared weight mapping, and the mapping's round trips and errors."""

import pytest
import torch

from loong_ckpt.pi05 import LEROBOT_PREFIX, from_lerobot, to_lerobot
from loong_models import load_model_config
from loong_models.embodied import Pi05Policy
from loong_models.embodied.pi05 import euler_sample
from loong_models.embodied.pi05.lerobot_reference import PI05Reference

CFG = load_model_config("pi05-tiny").embodied


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    ref = PI05Reference(CFG).eval()
    with torch.no_grad():  # norms and adaRMS start at zero: randomise them so they matter
        for name, p in ref.named_parameters():
            if "norm" in name or "dense" in name:
                p.normal_(0, 0.2)
    ours = Pi05Policy(CFG).eval()
    ours.load_state_dict(from_lerobot(ref.state_dict(), CFG))
    return ref, ours


def make_batch(seed: int = 1, batch: int = 3, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(batch, 1, 3, CFG.vision.image_size, CFG.vision.image_size, generator=g) * 2 - 1
    token_mask = torch.ones(batch, length, dtype=torch.bool)
    token_mask[1, 7:] = False  # a shorter prompt, right-padded
    image_masks = torch.ones(batch, 1, dtype=torch.bool)
    image_masks[2] = False  # a sample without its camera
    actions = torch.randn(batch, CFG.chunk_size, CFG.max_action_dim, generator=g)
    noise = torch.randn(actions.shape, generator=g)
    time = torch.tensor([0.05, 0.5, 0.95])[:batch]
    tokens = torch.randint(0, CFG.vocab_size, (batch, length), generator=g)
    ours = dict(images=images, image_masks=image_masks, tokens=tokens, token_mask=token_mask, actions=actions)
    theirs = dict(images=[images[:, 0]], img_masks=[image_masks[:, 0]], tokens=tokens, masks=token_mask)
    return ours, theirs, noise, time


def test_velocities_match_lerobot_pi05_within_1e4(pair):
    ref, ours = pair
    batch, ref_batch, noise, time = make_batch()
    x_t = time[:, None, None] * noise + (1 - time[:, None, None]) * batch["actions"]
    with torch.no_grad():
        v_ours, v_ref = ours.velocity(batch, x_t, time), ref.velocity(x_t=x_t, time=time, **ref_batch)
    assert v_ours.abs().max() > 0.1
    torch.testing.assert_close(v_ours, v_ref, atol=1e-4, rtol=0)


def test_flow_loss_and_gradients_match_lerobot_pi05(pair):
    ref, ours = pair
    batch, ref_batch, noise, time = make_batch(seed=2)
    ours.zero_grad(), ref.zero_grad()
    loss_ours = ours.flow_loss(batch, noise, time)
    loss_ref = ref(actions=batch["actions"], noise=noise, time=time, **ref_batch)
    torch.testing.assert_close(loss_ours, loss_ref, atol=1e-5, rtol=1e-5)
    loss_ours.mean().backward(), loss_ref.mean().backward()
    # tensors without a gradient (the VLM's last MLP and final norm feed nothing) count as zero
    ref_grads = from_lerobot(
        {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}, CFG
    )
    assert sum(p.grad is not None for p in ours.parameters()) > 80
    for name, p in ours.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_cached_sampler_matches_euler_over_the_reference_velocity(pair):
    ref, ours = pair
    batch, ref_batch, noise, _ = make_batch(seed=3)
    with torch.no_grad():
        ours_actions = ours.sample_actions(batch, noise=noise)
        ref_actions = euler_sample(
            lambda x, t: ref.velocity(x_t=x, time=t, **ref_batch), noise, CFG.num_inference_steps
        )
    torch.testing.assert_close(ours_actions, ref_actions, atol=1e-4, rtol=0)


def test_lerobot_and_openpi_layouts_round_trip(pair):
    ref, ours = pair
    ours_sd = ours.state_dict()
    lerobot = to_lerobot(ours_sd, CFG)
    assert all(k.startswith(LEROBOT_PREFIX) for k in lerobot)
    assert (
        "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.post_layernorm.weight"
        in lerobot
    )
    for layout in (lerobot, to_lerobot(ours_sd, CFG, prefix="")):
        back = from_lerobot(layout, CFG)
        assert back.keys() == ours_sd.keys()
        assert all(torch.equal(back[k], ours_sd[k]) for k in back)


def test_reading_accepts_transformers5_siglip_names_and_a_tied_only_embedding(pair):
    ref, _ = pair
    sd = dict(ref.state_dict())  # transformers 5 names: vision_tower.encoder..., lm_head tied
    embedding = sd.pop("paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight")
    sd["paligemma_with_expert.paligemma.lm_head.weight"] = embedding
    assert torch.equal(from_lerobot(sd, CFG)["embed_tokens.weight"], embedding)


def test_a_missing_or_unexpected_tensor_is_named(pair):
    ref, _ = pair
    sd = dict(ref.state_dict())
    del sd["time_mlp_in.bias"]
    with pytest.raises(KeyError, match="ckpt.safetensors: no tensor 'time_mlp_in.bias'"):
        from_lerobot(sd, CFG, source="ckpt.safetensors")
    sd = dict(ref.state_dict(), **{"state_proj.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="unexpected tensor 'state_proj.weight'"):
        from_lerobot(sd, CFG)
