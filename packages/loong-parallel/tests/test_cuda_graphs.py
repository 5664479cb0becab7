"""parallel.cuda_graphs: megatron's per-layer CUDA graphs as one key. Refused naming the key off
CUDA, without TE layers and with what megatron cannot capture; on CUDA it becomes megatron's
``cuda_graph_impl`` with TE's graph-safe RNG tracker, a config megatron itself accepts."""

import pytest
import torch

from loong_models import ModelConfig
from loong_parallel import ParallelConfig, require_features, runtime_transformer_fields
from loong_xpu import UnsupportedFeatureError, get_accelerator
from loong_xpu.backends.cuda import CudaAccelerator

MOE = dict(num_experts=8, expert_ffn_hidden_size=64, has_shared_experts=False)


def test_cuda_graphs_off_cuda_are_refused_naming_the_key():
    with pytest.raises(
        UnsupportedFeatureError,
        match=r"^parallel.cuda_graphs: the 'cpu' accelerator does not support 'cuda_graphs'",
    ):
        require_features(ModelConfig(), ParallelConfig(cuda_graphs="local"), get_accelerator("cpu"))
    with pytest.raises(ValueError, match=r"^parallel.cuda_graphs=local needs CUDA \(device type here: cpu\)"):
        runtime_transformer_fields(
            ParallelConfig(cuda_graphs="local"), dtype=torch.bfloat16, device_type="cpu"
        )


def test_cuda_graphs_on_local_layers_are_refused_naming_the_key():
    with pytest.raises(
        UnsupportedFeatureError,
        match=r"^parallel.cuda_graphs needs Transformer Engine layers, but model.layer_backend=local",
    ):
        require_features(
            ModelConfig(layer_backend="local"), ParallelConfig(cuda_graphs="local"), CudaAccelerator()
        )


@pytest.mark.parametrize(("pcfg", "kwargs", "what"), [
    (ParallelConfig(cuda_graphs="local"), MOE, "an MoE model"),
    (ParallelConfig(cuda_graphs="local", chunkpipe={"chunk_size": 64}), {}, "parallel.chunkpipe"),
    (ParallelConfig(cuda_graphs="local", offload_activations=["core_attn"]), {}, "parallel.offload_activations"),
], ids=["moe", "chunkpipe", "offload"])  # fmt: skip
def test_what_whole_layer_graphs_cannot_capture_is_refused_naming_both_keys(pcfg, kwargs, what):
    from loong_parallel.config import ChunkPipeConfig

    if isinstance(pcfg.chunkpipe, dict):
        pcfg.chunkpipe = ChunkPipeConfig(**pcfg.chunkpipe)
    with pytest.raises(ValueError, match=rf"^parallel.cuda_graphs=local cannot combine with {what}"):
        pcfg.validate(1, 4, 4, 2, **kwargs)


def test_an_unknown_cuda_graphs_value_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"parallel.cuda_graphs='te'; allowed: none, local"):
        ParallelConfig(cuda_graphs="te").validate(1, 4, 4, 2)
    ParallelConfig(cuda_graphs="local").validate(1, 4, 4, 2)  # a dense model: accepted


def test_cuda_graphs_become_megatrons_local_graphs_with_tes_rng_tracker_and_megatron_accepts_them():
    from megatron.core.transformer.transformer_config import TransformerConfig

    off = runtime_transformer_fields(ParallelConfig(), dtype=torch.bfloat16, device_type="cuda")
    assert (off["cuda_graph_impl"], off["use_te_rng_tracker"]) == ("none", False)
    fields = runtime_transformer_fields(
        ParallelConfig(cuda_graphs="local"), dtype=torch.bfloat16, device_type="cuda"
    )
    assert (fields["cuda_graph_impl"], fields["use_te_rng_tracker"]) == ("local", True)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **fields)
    assert config.cuda_graph_impl == "local" and config.cuda_graph_modules == []  # the whole layer
