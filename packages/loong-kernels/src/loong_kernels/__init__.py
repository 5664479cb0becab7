"""loong-kernels: fused training operators, each with a plain-torch reference.

    from loong_kernels import rms_norm, swiglu, linear_cross_entropy, deepseek_sparse_attention
    from loong_kernels import linear_cross_entropy_per_token  # the output layer's loss in training
    from loong_kernels import qkv_rope  # RoPE on megatron's fused QKV projection output

TileLang kernels run on CUDA when ``tilelang`` is installed; everywhere else the torch
references in :mod:`loong_kernels.reference` run. :mod:`loong_kernels.dispatch` decides.
"""

from loong_kernels.dispatch import choose, use_implementation
from loong_kernels.ops.dsa import (
    DSAOutput,
    deepseek_sparse_attention,
    indexer_kl_loss,
    lightning_indexer_scores,
    lightning_indexer_topk,
    lightning_indexer_topk_at,
    select_topk,
    sparse_attention_head_mean_probs,
    sparse_mla_attention,
)
from loong_kernels.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_per_token
from loong_kernels.ops.qkv_rope import qkv_rope
from loong_kernels.ops.rms_norm import rms_norm
from loong_kernels.ops.swiglu import swiglu

__version__ = "0.1.0"
__all__ = [
    "DSAOutput",
    "choose",
    "deepseek_sparse_attention",
    "indexer_kl_loss",
    "lightning_indexer_scores",
    "lightning_indexer_topk",
    "lightning_indexer_topk_at",
    "linear_cross_entropy",
    "linear_cross_entropy_per_token",
    "qkv_rope",
    "rms_norm",
    "select_topk",
    "sparse_attention_head_mean_probs",
    "sparse_mla_attention",
    "swiglu",
    "use_implementation",
]
