"""Multi-token-prediction parity helpers (DeepSeek-V3 and V3.2): the MTP layer's logits defined
on HF's own modules, and Loong's main and MTP logits of one forward pass."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loong_ckpt.testing import logits_in_process


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF directory ``path`` (all shards)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}


def _one_layer_more(path: Path) -> dict:
    """config.json's overrides that make HF build layer num_hidden_layers (the MTP layer) as one
    more decoder layer: per-layer lists (DeepSeek-V3.2's mlp_layer_types, layer_types) get the
    last layer's entry again."""
    config = json.loads((Path(path) / "config.json").read_text())
    out = {"num_hidden_layers": config["num_hidden_layers"] + 1}
    for key in ("mlp_layer_types", "layer_types"):
        if isinstance(config.get(key), list):
            out[key] = [*config[key], config[key][-1]]
    return out


def reference_mtp_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module (tech report §2.2) on HF's modules: the decoder's final hidden
    state h_i and token i+1's embedding -> eh_proj([enorm(emb); hnorm(h)]) -> the MTP decoder
    layer (HF layer num_hidden_layers; with V3.2 its DSA attention and indexer) ->
    shared_head.norm -> the shared LM head. Logits [batch, seq - 1, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg, n = model.config, model.config.num_hidden_layers
    # HF's loader reads the MTP layer's decoder tensors as one more decoder layer
    longer = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **_one_layer_more(path)
    )
    layer = longer.eval().model.layers[n]
    w = {k.removeprefix(f"model.layers.{n}."): v for k, v in hf_tensors(path).items()
         if k.startswith(f"model.layers.{n}.")}  # fmt: skip
    assert torch.equal(layer.self_attn.kv_b_proj.weight, w["self_attn.kv_b_proj.weight"])
    rms_norm = type(model.model.norm)  # the family's RMSNorm
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = rms_norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].weight.data.copy_(w[name + ".weight"])
    with torch.no_grad():
        h = model.model(tokens).last_hidden_state[:, :-1]  # after the final norm, as megatron's MTP gets it
        emb = model.model.embed_tokens(tokens[:, 1:])
        x = torch.cat([norms["enorm"](emb), norms["hnorm"](h)], -1) @ w["eh_proj.weight"].T
        b, s = x.shape[:2]
        pos = torch.arange(s).unsqueeze(0)
        # an explicit causal mask (True = attend), as HF's SDPA path builds it: V3.2's indexer needs one
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
        x = layer(
            x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos)
        )
        x = x[0] if isinstance(x, tuple) else x
        return model.lm_head(norms["shared_head.norm"](x))


def loong_logits_with_mtp(
    source: Path, tokens_file: Path, padded_vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loong's main logits and its MTP layer's logits (the output layer's first call in eval:
    megatron computes the MTP logits before the main ones), both cut to the main logits' vocab."""
    calls = []

    def hook(module, args, out):
        if type(module).__name__ == "ColumnParallelLinear" and out[0].shape[-1] == padded_vocab:
            calls.append(out[0].detach().transpose(0, 1).clone())  # the MTP loss overwrites them in place

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        main = logits_in_process(source, tokens_file)
    finally:
        handle.remove()
    assert len(calls) == 2 and torch.equal(calls[1][..., : main.shape[-1]], main)
    return main, calls[0][..., : main.shape[-1]]
