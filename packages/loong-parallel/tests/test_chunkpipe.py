"""ChunkPipe (PP = 1) against the unchunked run of the same sample, in fp32 on the CPU: the loss
and every parameter's gradient agree to 1e-5, for a plain and a packed (several documents) sample,
with chunk boundaries that fall inside documents, on a GQA (Llama) and an MLA (DeepSeek-V3,
dense) model; a chunk's attention equals the matching rows
of full causal attention (RoPE offset, bottom-right alignment); and what a step holds per token
of the sample is its key/value cache."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loong_models import build_model, build_transformer_config, load_model_config
from loong_models.chunked import enable_chunkpipe
from loong_models.packed_seq import packed_seq_params
from loong_parallel.chunkpipe import chunkpipe_forward_backward

SEQ = 48
TOL = 1e-5


TINY_GQA = ["foundation.num_layers=2", "foundation.hidden_size=64", "foundation.ffn_hidden_size=128",
            "foundation.kv_channels=16", "foundation.num_attention_heads=4", "foundation.num_query_groups=2"]  # fmt: skip
# DeepSeek-V3's MLA (q / kv latents, decoupled rotary key; a dense layer, then an MoE layer routed
# per token, with expert bias): without the balancing loss, which sees the whole micro-batch
TINY_MLA = ["foundation.moe.load_balancing=none", "foundation.moe.aux_loss_coeff=0.0"]
# DeepSeek-V3's long-context RoPE, with positions beyond the original length; mscale != mscale_all_dim
# so that the scale each MLA layer's table comes with is not 1
YARN = ["+foundation.rope_scaling={type: yarn, factor: 4.0, original_max_position_embeddings: 16, mscale: 1.0, "
        "mscale_all_dim: 0.5}"]  # fmt: skip
MODELS = {"gqa": ("tiny", TINY_GQA), "mla": ("deepseek-v3-tiny", TINY_MLA),
          "mla-yarn": ("deepseek-v3-tiny", TINY_MLA + YARN)}  # fmt: skip


def _tiny_model(name: str = "tiny", overrides: list[str] = TINY_GQA):
    cfg = load_model_config(name, [*overrides, "layer_backend=local"])
    tconfig = build_transformer_config(cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True,
                                       calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg, tconfig, device_type="cpu"), cfg.foundation.vocab_size


def _sample(vocab: int, doc_lengths: list[int] | None, seq: int = SEQ):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, vocab, (1, seq + 1), generator=g)
    loss_mask = (torch.rand(1, seq, generator=g) > 0.2).float()
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask}
    if doc_lengths is None:
        batch["position_ids"] = torch.arange(seq)[None]
    else:
        assert sum(doc_lengths) == seq
        batch["position_ids"] = torch.cat([torch.arange(n) for n in doc_lengths])[None]
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
    return batch


def _unchunked(model, batch):
    model.zero_grad()
    packed = None
    if "cu_seqlens" in batch:
        packed = packed_seq_params(batch["cu_seqlens"], int(torch.diff(batch["cu_seqlens"]).max()))
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed)
    loss = (per_token * batch["loss_mask"]).sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "attention, chunk_size",
    [("gqa", 12), ("gqa", 20), ("mla", 12), ("mla-yarn", 20)],
    ids=["gqa-4-chunks", "gqa-uneven-chunks", "mla-4-chunks", "mla-yarn-uneven-chunks"],
)
@pytest.mark.parametrize("docs", [None, [7, 19, 2, 20]], ids=["plain", "packed"])
def test_chunked_loss_and_gradients_equal_the_unchunked_run(megatron_cpu, attention, chunk_size, docs):
    model, vocab = _tiny_model(*MODELS[attention])
    batch = _sample(vocab, docs)
    ref_loss, ref_grads = _unchunked(model, batch)
    ref_counts = _expert_token_counts(model)
    assert bool(ref_counts) == attention.startswith("mla")  # the MLA model's second layer is MoE
    state = enable_chunkpipe(model)
    model.zero_grad()
    result = chunkpipe_forward_backward(model, state, batch, chunk_size, torch.device("cpu"))
    assert result.num_tokens == int(batch["loss_mask"].sum())
    assert abs(result.loss_sum - ref_loss) <= TOL * max(1.0, abs(ref_loss)), (result.loss_sum, ref_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=TOL, atol=TOL, msg=name)
    # expert bias learns from the tokens each expert got: every token counted once, as unchunked
    assert [c.tolist() for c in _expert_token_counts(model)] == [c.tolist() for c in ref_counts]
    assert state.cache == []  # the key/value cache is freed with the sample


def _expert_token_counts(model) -> list[torch.Tensor]:
    """The MoE routers' token counts per expert since the last call (then reset)."""
    routers = [m for m in model.modules() if getattr(m, "local_tokens_per_expert", None) is not None]
    counts = [r.local_tokens_per_expert.clone() for r in routers]
    for r in routers:
        r.local_tokens_per_expert.zero_()
    return counts


def test_each_chunk_reproduces_its_rows_of_the_full_sequence(megatron_cpu):
    """RoPE offset and bottom-right causal alignment: chunk i's per-token losses equal rows
    [start, end) of the unchunked forward (packed documents crossing chunk boundaries)."""
    model, vocab = _tiny_model()
    batch = _sample(vocab, [7, 19, 2, 20])
    packed = packed_seq_params(batch["cu_seqlens"], 20)
    with torch.no_grad():
        full = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed)
    state = enable_chunkpipe(model)
    state.begin_sample(batch["position_ids"][0], batch["cu_seqlens"].tolist())
    with torch.no_grad():
        for j, a in enumerate(range(0, SEQ, 16)):
            state.begin_chunk(j, a, a + 16, build_cache=True)
            rows = model(batch["tokens"][:, a : a + 16], batch["position_ids"][:, a : a + 16], None,
                         labels=batch["labels"][:, a : a + 16])  # fmt: skip
            torch.testing.assert_close(rows, full[:, a : a + 16], rtol=TOL, atol=TOL)
    state.end_sample()


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("deepseek-v32-tiny", [], r"sparse attention \(model.foundation.sparse_attention\)"),
        ("deepseek-v3-tiny", [], r"MoE layers with a load-balancing loss \(set model.foundation.moe.load_balancing=none"),
        ("deepseek-v3-tiny", [*TINY_MLA, "+foundation.moe.capacity_factor=1.25"], r"token dropping"),
    ],
    ids=["dsa", "moe-balancing-loss", "moe-token-dropping"],
)
def test_models_chunkpipe_cannot_run_are_refused(megatron_cpu, name, overrides, message):
    cfg = load_model_config(name, [*overrides, "layer_backend=local"])
    tconfig = build_transformer_config(cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True)
    with pytest.raises(ValueError, match=message):
        enable_chunkpipe(build_model(cfg, tconfig, device_type="cpu"))


def test_enabling_keeps_the_state_dict_keys_and_cannot_be_done_twice(megatron_cpu):
    model, _ = _tiny_model()
    keys = list(model.state_dict())
    enable_chunkpipe(model)
    assert list(model.state_dict()) == keys  # checkpoints of chunked and unchunked runs are alike
    with pytest.raises(ValueError, match="already enabled"):
        enable_chunkpipe(model)


def test_the_attention_mask_type_is_read_as_megatron_or_te_spells_it(megatron_cpu):
    """TE's core attention keeps its mask type as a string ("causal"), megatron's local one as an
    enum: both are causal; anything else is refused naming the layer."""
    model, _ = _tiny_model()
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.attn_mask_type = "causal"
    enable_chunkpipe(model)
    other, _ = _tiny_model()
    other.decoder.layers[0].self_attention.core_attention.attn_mask_type = "padding"
    with pytest.raises(ValueError, match="ChunkPipe needs causal attention \\(layer 0 has 'padding'\\)"):
        enable_chunkpipe(other)


class _PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops create while the mode is on (storages made
    before, such as the parameters, are not counted): the CPU stand-in for the allocator's peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def test_memory_beyond_the_key_value_cache_does_not_grow_with_the_sample(megatron_cpu):
    """Peak tensor bytes of a ChunkPipe step at two sample lengths, same chunk: each extra token
    costs its keys, values and their gradients (4 x layers x groups x head_dim fp32 values) and
    at most 15% more (the CPU attention's [chunk, keys] mask, the batch's own per-token fields);
    nothing else of the sample (QKV projections, concatenated K/V, RoPE tables) stays alive."""
    model, vocab = _tiny_model()
    state = enable_chunkpipe(model)
    cfg = model.config
    kv_bytes = 4 * cfg.num_layers * cfg.num_query_groups * cfg.kv_channels * 4
    peaks = {}
    for seq in (96, 224):
        batch = _sample(vocab, None, seq)
        model.zero_grad(set_to_none=True)
        with _PeakTensorBytes() as mode:
            chunkpipe_forward_backward(model, state, batch, 32, torch.device("cpu"))
        peaks[seq] = mode.peak
    per_token = (peaks[224] - peaks[96]) / 128
    assert kv_bytes <= per_token <= 1.15 * kv_bytes, (per_token, kv_bytes)
