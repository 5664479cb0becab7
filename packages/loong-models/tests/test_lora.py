"""LoRA on real megatron linears (local spec, CPU, TP=1): math and gradients against plain torch,
zero-init identity, freezing, checkpoint entries, config errors. TP=2 is tests/test_lora_train.py."""

import pytest
import torch
import torch.nn.functional as F

from loong_models import FoundationConfig, LoraConfig, ModelConfig, build_model, build_transformer_config
from loong_models.lora import LoraError, is_adapter_key, lora_parameters

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def tiny() -> FoundationConfig:
    return FoundationConfig(family="llama", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip


def build(lora: LoraConfig | None, seed: int = 0):
    torch.manual_seed(seed)
    f = tiny()
    config = build_transformer_config(f, use_cpu_initialization=True, calculate_per_token_loss=True,
                                      params_dtype=torch.float32)  # fmt: skip
    return build_model(ModelConfig(foundation=f, layer_backend="local", lora=lora), config, device_type="cpu")


@pytest.mark.parametrize("target", TARGETS)
def test_lora_linear_equals_plain_torch(megatron_cpu, target):
    cfg = LoraConfig(rank=4, alpha=8.0)
    model = build(cfg)
    layer = model.decoder.layers[1]
    module = {"linear_qkv": layer.self_attention.linear_qkv, "linear_proj": layer.self_attention.linear_proj,
              "linear_fc1": layer.mlp.linear_fc1, "linear_fc2": layer.mlp.linear_fc2}[target]  # fmt: skip
    with torch.no_grad():
        module.lora_b.normal_()  # a trained-looking B (zero at init)
    x = torch.randn(5, 2, module.weight.shape[1], requires_grad=True)  # [s, b, in]
    out, bias = module(x)
    assert bias is None

    a = module.lora_a.detach().clone().requires_grad_(True)
    b = module.lora_b.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    ref = xr @ module.weight.detach().T + (xr @ a.T @ b.T) * (8.0 / 4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(module.lora_a.grad, a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.lora_b.grad, b.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    assert module.weight.grad is None  # frozen


def test_zero_init_keeps_the_model_and_only_adapters_train(megatron_cpu):
    base, lora = build(None), build(LoraConfig(rank=4, targets=TARGETS))
    base_sd = base.state_dict()
    for k, v in lora.state_dict().items():
        if is_adapter_key(k) or not isinstance(v, torch.Tensor):  # adapters; _extra_state (None)
            continue
        assert torch.equal(v, base_sd[k]), k  # the same base weights for the same seed
    tokens = torch.randint(0, 128, (2, 16))
    pos = torch.arange(16).expand(2, -1)
    assert torch.equal(base(tokens, pos, None), lora(tokens, pos, None))

    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    adapters = {n for n, _ in lora_parameters(lora)}
    assert trainable == adapters and len(adapters) == 2 * 4 * 2  # A and B, 4 linears, 2 layers
    assert all(torch.count_nonzero(p) == 0 for n, p in lora.named_parameters() if n.endswith("lora_b"))


def test_adapter_init_is_independent_of_global_rng_use(megatron_cpu):
    """Adapters depend on the seed and the layer / module, not on how much RNG the base used."""
    a = build(LoraConfig(rank=4))
    torch.manual_seed(0)
    torch.rand(1000)  # a different amount of RNG consumed before the adapters are made
    b = build_model(ModelConfig(foundation=tiny(), layer_backend="local", lora=LoraConfig(rank=4)),
                    build_transformer_config(tiny(), use_cpu_initialization=True), device_type="cpu")  # fmt: skip
    pa, pb = dict(lora_parameters(a)), dict(lora_parameters(b))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["decoder.layers.0.self_attention.linear_qkv.lora_a"],
                           pa["decoder.layers.1.self_attention.linear_qkv.lora_a"])  # fmt: skip


def test_checkpoint_entries_have_the_base_weights_global_layout(megatron_cpu):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    model = build(LoraConfig(rank=4))
    sd = model.sharded_state_dict()
    qkv_a = sd["decoder.layers.0.self_attention.linear_qkv.lora_a"]
    assert isinstance(qkv_a, ShardedTensor) and qkv_a.key == "decoder.layers.self_attention.linear_qkv.lora_a"
    assert tuple(qkv_a.global_shape) == (2, 4, 32)  # [layers, rank, in]
    proj_b = sd["decoder.layers.1.self_attention.linear_proj.lora_b"]
    assert tuple(proj_b.global_shape) == (2, 32, 4) and proj_b.global_offset[0] == 1
    # fc1's B is split into gate / up halves exactly like fc1's weight
    assert isinstance(sd["decoder.layers.0.mlp.linear_fc1.lora_b"], ShardedTensorFactory)
    assert isinstance(sd["decoder.layers.0.mlp.linear_fc1.weight"], ShardedTensorFactory)


def test_config_errors_name_the_key(megatron_cpu):
    with pytest.raises(LoraError, match=r"model.lora.targets=\['nope'\] match no linear"):
        build(LoraConfig(targets=["nope"]))
    with pytest.raises(LoraError, match="model.lora.components: 'image_encoder' is not a component"):
        build(LoraConfig(components=["foundation", "image_encoder"]))
    with pytest.raises(LoraError, match="not inside a transformer layer"):
        build(LoraConfig(targets=["output_layer"]))
    with pytest.raises(ValueError, match=r"model.lora.rank=0 must be >= 1"):
        build(LoraConfig(rank=0))


def test_component_absent_from_this_pipeline_stage_is_skipped(megatron_cpu):
    from loong_models.lora import apply_lora

    model = build(None)
    n = apply_lora(
        {"foundation": model, "image_encoder": None}, LoraConfig(components=["foundation", "image_encoder"])
    )
    assert n == 2 * 4
    assert apply_lora({"foundation": None}, LoraConfig()) == 0  # e.g. an encoder-only stage


def test_dropout_is_training_only(megatron_cpu):
    model = build(LoraConfig(rank=4, dropout=0.5))
    module = model.decoder.layers[0].mlp.linear_fc2
    with torch.no_grad():
        module.lora_b.normal_()
    x = torch.randn(4, 1, module.weight.shape[1])
    model.eval()
    ref = F.linear(x, module.weight) + (x @ module.lora_a.T @ module.lora_b.T) * module.lora_scale
    torch.testing.assert_close(module(x)[0], ref)
    model.train()
    assert not torch.allclose(module(x)[0], ref)


# --- VLM: alignment (frozen encoder + foundation) and LoRA on several components ---


def _tiny_vlm(overrides=(), lora: LoraConfig | None = None):
    from loong_models import load_model_config

    torch.manual_seed(0)
    cfg = load_model_config("tiny-vlm", ["layer_backend=local", "foundation.num_layers=2", *overrides])
    cfg.lora = lora
    config = build_transformer_config(cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True,
                                      calculate_per_token_loss=True)  # fmt: skip
    return build_model(cfg, config, device_type="cpu")


def test_vlm_alignment_trains_only_the_projector(megatron_cpu):
    from loong_models.testing import packed_batch

    model = _tiny_vlm(["+image_encoder.freeze=true", "+foundation.freeze=true"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in model.image_projector.parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(**packed_batch()).sum().backward()
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != n.startswith("image_projector."), n


def test_vlm_lora_on_foundation_and_encoder(megatron_cpu):
    from loong_models.testing import packed_batch

    lora = LoraConfig(rank=4, components=["foundation", "image_encoder"])
    model, base = _tiny_vlm(lora=lora), _tiny_vlm()
    adapters = {n for n, _ in lora_parameters(model)}
    assert any(n.startswith("image_encoder.") for n in adapters) and any(
        n.startswith("foundation.") for n in adapters
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapters | {
        n for n, _ in model.named_parameters() if n.startswith("image_projector.")
    }
    with torch.no_grad():  # zero-init adapters: the same model
        torch.testing.assert_close(model(**packed_batch()), base(**packed_batch()), rtol=0, atol=0)
