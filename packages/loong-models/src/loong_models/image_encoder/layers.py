"""Window attention for megatron's TransformerBlock: the block hands every layer the same packed
parameters, so the window boundaries travel inside them and window layers pick them up."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_layer import TransformerLayer

from loong_models.packed_seq import HostPackedSeqParams


@dataclass
class VisionPackedSeqParams(HostPackedSeqParams):
    """THD parameters of a packed batch of images (one segment per image / video frame), plus
    ``window``: the same patches cut into attention windows (Qwen2.5-VL), or None. Both carry
    their boundaries on the host too (``bounds``)."""

    window: HostPackedSeqParams | None = None


class WindowAttentionLayer(TransformerLayer):
    """A megatron TransformerLayer whose attention runs within windows: it swaps in
    ``packed_seq_params.window`` (megatron passes ``packed_seq_params`` as a keyword, also
    under activation recompute)."""

    def forward(self, *args, **kwargs):
        params = kwargs.get("packed_seq_params")
        window = getattr(params, "window", None)
        if window is None:
            raise ValueError("a window-attention layer needs VisionPackedSeqParams with window boundaries")
        kwargs["packed_seq_params"] = window
        return super().forward(*args, **kwargs)
