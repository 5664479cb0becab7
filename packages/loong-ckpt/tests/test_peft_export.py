"""PEFT export in process: an adapters-only checkpoint (random fused Q/K/V, out, gate/up, down
adapters) exported in PEFT's layout; peft loads it onto the HF base with the outputs of the base
weights plus the fused updates split by the mapping rules."""

from __future__ import annotations

import json

import torch

from loong_ckpt.testing.hf_models import make_hf_model


def _adapter_checkpoint(hf, out, f, rank: int = 4) -> dict[str, torch.Tensor]:
    from loong_ckpt.components import checkpoint_meta
    from loong_ckpt.mcore_io import Chunk, write_checkpoint

    heads, h = f.num_attention_heads * f.head_dim, f.hidden_size
    shapes = {"self_attention.linear_qkv": (heads + 2 * f.query_groups * f.head_dim, h),
              "self_attention.linear_proj": (h, heads), "mlp.linear_fc1": (2 * f.ffn_hidden_size, h),
              "mlp.linear_fc2": (h, f.ffn_hidden_size)}  # fmt: skip
    torch.manual_seed(0)
    data = {}
    for m, (o, i) in shapes.items():
        data[f"decoder.layers.{m}.lora_a"] = torch.randn(f.num_layers, rank, i) * 0.1
        data[f"decoder.layers.{m}.lora_b"] = torch.randn(f.num_layers, o, rank) * 0.1
    out.mkdir()
    chunks = [Chunk(k, tuple(v.shape), (0,) * v.dim(), tuple(v.shape), v.dtype) for k, v in data.items()]
    write_checkpoint(out, chunks, [], lambda c: data[c.key])
    meta = {"step": 1, "params": "trainable", **checkpoint_meta(f), "lora": {"rank": rank, "alpha": 8.0, "base": str(hf)}}
    (out / "loong.json").write_text(json.dumps(meta))
    return data


def test_peft_loads_an_exported_adapter_with_the_split_fused_updates(tmp_path):
    import transformers
    from peft import PeftModel

    from loong_ckpt.components import bind_components
    from loong_ckpt.mapping import units
    from loong_ckpt.online import read_hf_model
    from loong_ckpt.peft import export_peft

    hf = make_hf_model(tmp_path / "hf", "qwen2", vocab=1000)
    f = read_hf_model(hf)
    data = _adapter_checkpoint(hf, tmp_path / "ckpt", f)
    export_peft(tmp_path / "ckpt", tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    merged = {k: v.clone() for k, v in base.state_dict().items()}
    for rule, layer, _ in units(bind_components(f)[0][0], f):  # W + alpha / rank * B @ A, then split
        stem = rule.mcore.removesuffix(".weight")
        if stem + ".lora_a" in data:
            update = 2.0 * (data[stem + ".lora_b"][layer] @ data[stem + ".lora_a"][layer])
            for name, part in zip(rule.hf_names(layer), rule.to_hf(update, f)):
                merged[name] += part
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reference.load_state_dict(merged)
    tokens = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")(tokens).logits
        want = reference(tokens).logits
    assert (want - plain).abs().max() > 1e-2
    torch.testing.assert_close(adapted, want, atol=1e-5, rtol=1e-5)
