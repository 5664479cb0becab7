"""DeepStack (Qwen3-VL): features of intermediate ViT layers, projected to the LLM's width, are
added to the hidden states at the vision tokens after the LLM's first layers.

The additions travel as megatron's ``context`` argument (a ``[K, S, B, H]`` tensor, zero outside
the vision tokens; ``GPTModel.forward(extra_block_kwargs={"context": ...})``): TransformerBlock
hands ``context`` to every layer and returns it unchanged from layers without cross-attention,
and its activation recompute saves it as a checkpointed input, so the recomputed forward adds the
same features. Layer ``i`` (global, 0-based) adds ``context[i]`` for ``i < K``."""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer


class DeepStackLayer(TransformerLayer):
    """A megatron TransformerLayer that adds ``context[layer]`` to its output when given."""

    def forward(self, *args, **kwargs):
        hidden, context = super().forward(*args, **kwargs)
        index = self.layer_number - 1  # megatron numbers layers globally from 1
        if context is not None and index < context.shape[0]:
            hidden = hidden + context[index].to(hidden.dtype)
        return hidden, context
