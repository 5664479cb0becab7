"""Pi0.5's configuration: a SigLIP tower, a Gemma VLM, a smaller Gemma action expert, flow matching.

Field names follow LeRobot's ``PI05Config`` / OpenPI where they exist (``chunk_size`` is OpenPI's
``action_horizon``) so that configs and checkpoints read across. ``num_parameters`` is computed
from the sizes alone (nothing is built), so the full shape can be counted on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPILE_SCOPES = ("none", "per_layer", "policy")
# torch.compile modes the compiled scope may take ("reduce-overhead": CUDA graphs of the compiled graphs)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
ATTENTION_IMPLS = ("sdpa", "eager")


@dataclass
class SiglipConfig:
    """The SigLIP vision tower (PaliGemma's: So400m/14, without the pooling head)."""

    image_size: int = 224
    patch_size: int = 14
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_attention_heads: int = 16
    norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def num_parameters(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        embed = 3 * self.patch_size**2 * h + h + self.num_patches * h
        layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
        return embed + self.num_layers * layer + 2 * h  # + post layernorm

    def validate(self, prefix: str) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"{prefix}.image_size={self.image_size} is not a multiple of patch_size={self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{prefix}.hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")  # fmt: skip


@dataclass
class GemmaConfig:
    """One Gemma decoder (GeGLU MLP, (1 + w) RMSNorm, embeddings scaled by sqrt(width))."""

    width: int = 2048
    depth: int = 18
    mlp_dim: int = 16384
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    norm_eps: float = 1e-6

    def layer_parameters(self, adaptive_cond: int | None) -> int:
        """One decoder layer; adaRMS norms (``adaptive_cond`` = the condition width) hold a
        ``cond -> 3 * width`` linear instead of a weight vector."""
        w, hd = self.width, self.head_dim
        attn = w * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * w * self.mlp_dim
        return attn + mlp + 2 * self.norm_parameters(adaptive_cond)

    def norm_parameters(self, adaptive_cond: int | None) -> int:
        return self.width if adaptive_cond is None else adaptive_cond * 3 * self.width + 3 * self.width

    def validate(self, prefix: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{prefix}.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )


@dataclass
class Pi05Config:
    """Pi0.5 (pi_0.5): PaliGemma (SigLIP + Gemma) + a Gemma action expert sharing joint attention
    layer by layer; time enters the expert through adaRMS; actions are flow-matched chunks."""

    vision: SiglipConfig = field(default_factory=SiglipConfig)
    vlm: GemmaConfig = field(default_factory=GemmaConfig)
    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=1024, mlp_dim=4096))
    vocab_size: int = 257152  # PaliGemma's (the Gemma tokenizer + 1024 location + 128 segmentation tokens)
    rope_theta: float = 10000.0
    num_cameras: int = 1
    chunk_size: int = 50  # the action horizon H
    max_action_dim: int = 32  # actions (and states) are zero-padded to this width
    max_state_dim: int = 32
    state_bins: int = 256  # the prompt carries the state discretised into this many bins of [-1, 1]
    tokenizer_max_length: int = 200
    num_inference_steps: int = 10
    time_sampling_beta_alpha: float = 1.5
    time_sampling_beta_beta: float = 1.0
    time_sampling_scale: float = 0.999
    time_sampling_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0
    freeze_vision_encoder: bool = False
    train_expert_only: bool = False
    # torch.compile scope (LoongForge's key): "none" (eager), "per_layer" (each SigLIP layer and
    # each joint layer compiled; the layers of a kind share one compiled graph, so compiling is quick)
    # or "policy" (the whole training loss in one graph: fewer host launches, a longer compile)
    compile_scope: str = "none"
    # torch.compile's mode for that scope: "default", or "reduce-overhead" (each compiled forward and
    # backward graph replayed as a CUDA graph: one launch instead of its kernels' launches; the
    # host-bound full-shape step spends most of its host time launching them)
    compile_mode: str = "default"
    # the joint attention: "sdpa" (torch's kernels) or "eager" (matmuls + fp32 softmax; faster on
    # CUDA at Pi0.5's shape, where SDPA with a mask falls back to its memory-efficient kernel)
    attention_impl: str = "sdpa"

    def validate(self, prefix: str = "model.embodied") -> None:
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(
                f"{prefix}.compile_scope={self.compile_scope!r}; allowed: {', '.join(COMPILE_SCOPES)}"
            )
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"{prefix}.compile_mode={self.compile_mode!r}; allowed: {', '.join(COMPILE_MODES)}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"{prefix}.attention_impl={self.attention_impl!r}; allowed: {', '.join(ATTENTION_IMPLS)}"
            )
        self.vision.validate(f"{prefix}.vision")
        self.vlm.validate(f"{prefix}.vlm")
        self.expert.validate(f"{prefix}.expert")
        for key in ("num_heads", "num_kv_heads", "head_dim", "depth"):
            if getattr(self.vlm, key) != getattr(self.expert, key):
                raise ValueError(f"{prefix}.expert.{key}={getattr(self.expert, key)} must equal {prefix}.vlm.{key}="
                                 f"{getattr(self.vlm, key)}: the two share one attention per layer")  # fmt: skip
        if self.expert.width % 2:
            raise ValueError(
                f"{prefix}.expert.width={self.expert.width} must be even (sine-cosine time embedding)"
            )

    def num_parameters(self) -> int:
        """Exact count of what ``Pi05Policy`` builds (the expert has no embedding or LM head;
        the VLM's LM head is tied to its embedding)."""
        v, e = self.vlm, self.expert
        n = self.vision.num_parameters() + self.vision.hidden_size * v.width + v.width  # + projector
        n += self.vocab_size * v.width + v.depth * v.layer_parameters(None) + v.norm_parameters(None)
        n += e.depth * e.layer_parameters(e.width) + e.norm_parameters(e.width)
        a, w = self.max_action_dim, e.width
        return n + 2 * (a * w) + w + a + 2 * (w * w + w)  # action in/out, time MLP
