"""A bad config key or value fails before training starts, naming the key and what is allowed;
missing data names the path."""

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from loong_models import FAMILIES
from loong_train.main import to_config
from loong_train.schema import ConfigError, validate
from loong_train.testing import compose_config


def test_default_config_is_valid():
    cfg = to_config(compose_config())
    assert validate(cfg, world_size=1) == 2  # 16 samples = 8 per micro-batch x 2 micro-batches
    assert cfg.model.foundation.num_layers == 4


def test_unknown_key_is_named():
    with pytest.raises(ConfigKeyError, match="num_heads"):
        to_config(compose_config("+model.foundation.num_heads=3"))


def test_wrong_type_is_named():
    with pytest.raises(ValidationError) as e:
        to_config(compose_config("train.steps=many"))
    assert e.value.full_key == "train.steps"


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.tp=3", r"parallel.tp=3 must divide the attention heads \(4\) and KV groups \(2\)"),
        ("train.global_batch_size=12", r"train.global_batch_size=12 must be a multiple of train.micro_batch_size"),
        ("data.seq_length=4096", r"data.seq_length=4096 must be in \[2, model.foundation.max_position_embeddings"),
        ("train.profile.steps=0", r"train.profile.steps=0 must be >= 1"),
        ("optim.host_threads=0", r"optim.host_threads=0 must be >= 1 or null \(automatic\)"),
    ],
)
def test_bad_values_name_the_key(override, message):
    cfg = to_config(compose_config(override))
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=1)


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("train.dtype=fp8", "train.dtype", "auto, bf16, fp16, fp32"),
        ("optim.schedule=step", "optim.schedule", "cosine, linear, constant"),
        ("optim.offload_update=cpu", "optim.offload_update", "host, device"),
        ("data.kind=audio", "data.kind", "text, chat, multimodal, lerobot, diffusion"),
        ("parallel.moe_token_dispatcher=flex", "parallel.moe_token_dispatcher", "alltoall, allgather"),
        ("model.foundation.family=gpt2", "model.foundation.family", ", ".join(FAMILIES)),
        ("model.layer_backend=fast", "model.layer_backend", "auto, te, local"),
        ("++model.foundation.recompute=some", "model.foundation.recompute", "selective, full"),
        ("+data.lerobot.norm_mode=zscore", "data.lerobot.norm_mode", "mean_std, min_max, quantiles"),
        ("++model.foundation.precision.fp8=maybe", "model.foundation.precision.fp8", "off, on, adaptive"),
        ("++model.foundation.precision.recipe=nvfp4", "model.foundation.precision.recipe",
         "tensorwise, blockwise, delayed, mxfp8"),
        ("++model.attention_backend=sdpa", "model.attention_backend", "auto, flash, fused, unfused"),
        ("++model.grouped_gemm_kernel=fast", "model.grouped_gemm_kernel", "auto, cublas, cutlass, cublaslt"),
    ],
)
def test_choices_name_the_allowed_values(override, key, allowed):
    """Choices are enums: the schema names the key and the allowed values (no hand-written check)."""
    with pytest.raises(ValidationError, match=rf"Invalid value '.*', expected one of \[{allowed}\]") as e:
        to_config(compose_config(override))
    assert e.value.full_key == key


def test_an_adaptive_fp8_run_without_a_policy_is_refused_naming_the_key():
    cfg = to_config(compose_config("++model.foundation.precision.fp8=adaptive"))
    with pytest.raises(ConfigError, match=r"model.foundation.precision.fp8=adaptive needs model.foundation.precision.policy"):
        validate(cfg, world_size=1)


def test_an_fp8_output_layer_without_the_fused_loss_is_refused_naming_the_key():
    cfg = to_config(compose_config("++model.foundation.precision.fp8=on", "++model.foundation.precision.fp8_output_layer=true"))
    with pytest.raises(ConfigError, match=r"model.foundation.precision.fp8_output_layer=true needs model.foundation.output_loss=fused"):
        validate(cfg, world_size=1)


def test_world_size_must_fit_layout():
    cfg = to_config(compose_config("parallel.tp=2", "parallel.pp=2"))
    with pytest.raises(ConfigError, match=r"world size 2 is not divisible by parallel.tp \* parallel.pp \* parallel.cp = 2 \* 2 \* 1"):
        validate(cfg, world_size=2)


def test_unknown_zoo_model_lists_the_zoo():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="qwen3-0.6b"):
        compose_config("model=gpt5")


def test_cli_reports_config_error_and_missing_data(run_train):
    run = run_train(["parallel.tp=3", "train.steps=1"])
    assert run.returncode != 0
    assert "config error: parallel.tp=3 must divide" in run.stderr
    assert not (run.out_dir / "checkpoints").exists(), "nothing may be written for a bad config"

    run = run_train(["data.sources=[/nonexistent/corpus.txt]", "train.steps=1"], name="nodata")
    assert run.returncode != 0
    assert "/nonexistent/corpus.txt" in run.stderr
    assert "Traceback" not in run.stderr


def test_context_parallelism_names_what_it_cannot_combine_with():
    # DP load balancing plans over the DP group: every CP rank of a DP rank gets the same samples
    validate(to_config(compose_config("parallel.cp=2", "parallel.balance.enabled=true", "data.packing=thd",
                                      "data.seq_length=256")), world_size=4)  # fmt: skip
    vlm = compose_config("parallel.cp=2", "parallel.tp=2", "data.seq_length=256", preset="vlm")
    validate(to_config(vlm), world_size=4)  # multimodal data: the shared encoder layout
    bad = vlm.copy()
    OmegaConf.update(bad, "model.image_encoder.tensor_model_parallel_size", 1)  # what hetero_dp needs
    for key, value in (("model.image_encoder.tensor_model_parallel_size", 1), ("parallel.encoder_layout", "hetero_dp")):
        OmegaConf.update(bad, key, value)
        with pytest.raises(ConfigError, match=rf"parallel.cp=2 cannot combine with {key}={value}"):
            validate(to_config(bad), world_size=4)
    cfg = to_config(compose_config("parallel.cp=2", "data.seq_length=250"))
    with pytest.raises(ConfigError, match=r"data.seq_length=250 must be a multiple of 2 x parallel.cp = 4"):
        validate(cfg, world_size=2)
    # DeepSeek sparse attention runs all-gather CP only (as megatron-core's DSA); dense attention never
    with pytest.raises(ConfigError, match=r"parallel.cp=2 cannot combine with parallel.cp_comm_type=p2p \(DeepSeek "
                                          r"sparse attention, model.foundation.sparse_attention, runs context "
                                          r"parallelism with parallel.cp_comm_type=allgather only\)"):  # fmt: skip
        validate(to_config(compose_config("parallel.cp=2", "model=deepseek-v32-tiny")), world_size=2)
    validate(to_config(compose_config("parallel.cp=2", "parallel.cp_comm_type=allgather", "model=deepseek-v32-tiny")),
             world_size=2)  # fmt: skip
    with pytest.raises(ConfigError, match=r"parallel.cp=2 cannot combine with parallel.cp_comm_type=allgather "
                                          r"\(all-gather CP serves DeepSeek sparse attention"):  # fmt: skip
        validate(to_config(compose_config("parallel.cp=2", "parallel.cp_comm_type=allgather")), world_size=2)
    # multi-latent attention and multi-token prediction run under CP (parity: test_context_parallel.py)
    validate(to_config(compose_config("parallel.cp=2", "model=deepseek-v3-tiny", "model.foundation.mtp_num_layers=1")),
             world_size=2)  # fmt: skip


def test_wan_context_parallelism_cuts_samples_into_cp_parts_and_names_what_it_cannot_combine_with():
    def wan(*overrides: str):
        return to_config(compose_config(*overrides, preset="wan"))

    validate(wan("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"), world_size=4)
    with pytest.raises(ConfigError, match=r"data.seq_length=16 must be a multiple of parallel.cp = 3 \(every "
                                          r"sequence is cut into cp equal parts\)"):  # fmt: skip
        validate(wan("parallel.cp=3"), world_size=3)
    with pytest.raises(ConfigError, match=r"parallel.cp=2 cannot combine with parallel.cp_comm_type=a2a "
                                          r"\(model.diffusion.num_attention_heads=2 / parallel.tp=2 heads"):  # fmt: skip
        validate(wan("parallel.cp=2", "parallel.tp=2", "parallel.cp_comm_type=a2a"), world_size=4)
    with pytest.raises(ConfigError, match=r"parallel.cp=2 cannot combine with parallel.cp_comm_type=allgather"):
        validate(wan("parallel.cp=2", "parallel.cp_comm_type=allgather"), world_size=2)


@pytest.mark.parametrize("overrides, what", [
    (["data.packing=thd"], r"data.packing=thd \(a packed step's shapes change"),
    (["++model.foundation.recompute=selective"], r"model.foundation.recompute \(megatron drops"),
    (["model=tiny-vlm"], r"a model with an image encoder"),
])  # fmt: skip
def test_cuda_graphs_name_what_they_cannot_capture(overrides, what):
    assert validate(to_config(compose_config("parallel.cuda_graphs=local")), world_size=1) == 2
    cfg = to_config(compose_config("parallel.cuda_graphs=local", *overrides))
    with pytest.raises(ConfigError, match=rf"parallel.cuda_graphs=local cannot combine with {what}"):
        validate(cfg, world_size=1)


@pytest.mark.parametrize("preset, what", [
    ("vlm", r"a model with an image encoder \(a VLM's micro-batch is a pack whose segment layout, packed_seq_params, "
            r"is set on the host per micro-batch: megatron replays a layer only with the captured one"),
    ("wan", r"a diffusion model \(the DiT's own TransformerConfig does not take cuda_graph_impl"),
    ("pi05", r"an embodied model \(plain torch layers: nothing is captured; their CUDA graphs are "
             r"model.embodied.compile_mode=reduce-overhead\)"),
])  # fmt: skip
def test_cuda_graphs_are_refused_for_models_whose_layers_megatron_does_not_capture_as_one_layout(preset, what):
    """Megatron's per-layer graphs are a language model's: a VLM (its per-micro-batch host-side pack
    layout), a DiT and a plain-torch policy are refused at validation, naming the key and why;
    pi05's own CUDA graphs (torch.compile's reduce-overhead) are another key and still validate."""
    cfg = lambda *o: to_config(compose_config(*o, preset=preset))  # noqa: E731
    validate(cfg(), world_size=1)
    with pytest.raises(ConfigError, match=rf"^parallel.cuda_graphs=local cannot combine with {what}"):
        validate(cfg("parallel.cuda_graphs=local"), world_size=1)
    if preset == "pi05":
        validate(cfg("model.embodied.compile_mode=reduce-overhead"), world_size=1)


def test_init_from_without_a_chosen_phase_or_rate_gets_the_fine_tuning_recipe():
    from loong_train.recipe import apply_finetune_recipe

    def recipe(*overrides, phase="pretrain"):
        raw = compose_config(*overrides)
        return apply_finetune_recipe(raw, phase, list(overrides)), to_config(raw).optim

    line, optim = recipe("train.init_from=/ckpt", "optim.warmup_steps=3")
    assert "fine-tuning recipe phase=finetune (optim.lr=0.0001 -> min_lr=1e-05, warm-up 3 steps)" in line
    assert (optim.lr, optim.min_lr, optim.warmup_steps) == (1e-4, 1e-5, 3)  # the user's warm-up wins
    for overrides, phase in [(("train.init_from=/ckpt", "optim.lr=3e-3"), "pretrain"),
                             (("train.init_from=/ckpt", "phase=pretrain"), "pretrain"),
                             (("train.init_from=/ckpt",), "sft"), ((), "pretrain")]:  # fmt: skip
        line, optim = recipe(*overrides, phase=phase)
        assert line is None and optim.lr == 3e-3 or phase == "sft", overrides
    _, finetune = recipe("phase=finetune", phase="finetune")
    assert finetune.lr == 1e-4  # the phase loong-convert's printed command names


def test_wgrad_fusion_is_refused_by_name_on_a_model_without_linears_to_fuse():
    """pi05 is plain torch layers; a language model (local layers on the CPU) takes the lever, and
    auto (null) is valid everywhere."""
    assert validate(to_config(compose_config("parallel.wgrad_fusion=true")), world_size=1) == 2
    pi05 = lambda *o: to_config(compose_config(*o, preset="pi05"))  # noqa: E731
    validate(pi05("parallel.wgrad_fusion=null"), world_size=1)
    with pytest.raises(ConfigError, match=r"parallel.wgrad_fusion=true cannot combine with an embodied model"):
        validate(pi05("parallel.wgrad_fusion=true"), world_size=1)


def test_the_fused_output_loss_names_what_it_cannot_combine_with():
    """model.foundation.output_loss=fused: one rank computes the whole vocabulary's loss; tensor /
    sequence parallelism, ChunkPipe and MTP cannot, pipeline and context parallelism are not tested yet."""
    fused = "++model.foundation.output_loss=fused"
    validate(to_config(compose_config(fused)), world_size=1)
    validate(to_config(compose_config(fused)), world_size=2)  # data parallelism
    for overrides, what in (
        (["parallel.tp=2"], r"parallel.tp=2 \(the output layer's vocabulary is split across ranks\)"),
        # sequence parallelism needs tp > 1: the first error named is the TP one
        (["parallel.tp=2", "parallel.sequence_parallel=true"], r"parallel.tp=2"),
        (["parallel.chunkpipe.chunk_size=64", "train.micro_batch_size=1", "train.global_batch_size=2"],
         r"parallel.chunkpipe \(it computes each chunk's loss itself\)"),
        (["parallel.pp=2"], r"parallel.pp=2 \(not yet tested against megatron's loss\)"),
        (["parallel.cp=2", "data.seq_length=256"], r"parallel.cp=2 \(not yet tested against megatron's loss\)"),
    ):
        with pytest.raises(ConfigError, match=rf"model.foundation.output_loss=fused cannot combine with {what}"):
            validate(to_config(compose_config(fused, *overrides)), world_size=2)
    with pytest.raises((ConfigError, ValueError), match=r"model.foundation.output_loss=fused cannot run with "
                                                        r"model.foundation.mtp_num_layers=1"):  # fmt: skip
        validate(to_config(compose_config(fused, "model=deepseek-v3-tiny", "model.foundation.mtp_num_layers=1")),
                 world_size=1)  # fmt: skip
    with pytest.raises(ValidationError, match="output_loss"):  # the choices are named by OmegaConf
        to_config(compose_config("++model.foundation.output_loss=logits"))


def test_the_fused_qkv_rope_names_what_it_cannot_combine_with():
    """model.fused_qkv_rope: megatron's one-kernel RoPE on the fused QKV output takes plain 1-D RoPE
    on whole sequences of unnormalised queries and keys."""
    on = "++model.fused_qkv_rope=true"
    validate(to_config(compose_config(on)), world_size=1)
    for overrides, what in (
        (["data.packing=thd"], "data.packing=thd"),
        (["parallel.cp=2", "data.seq_length=256"], "parallel.cp=2"),
        (["parallel.chunkpipe.chunk_size=64", "train.micro_batch_size=1", "train.global_batch_size=2"],
         "parallel.chunkpipe.chunk_size"),
    ):
        with pytest.raises(ConfigError, match=rf"model.fused_qkv_rope=true cannot be combined with {what}: "):
            validate(to_config(compose_config(on, *overrides)), world_size=2)
    for model, what in (("qwen3-0.6b", r"model.foundation.family=qwen3 \(QK norms\)"),
                        ("deepseek-v3-tiny", "model.foundation.mla"), ("tiny-vlm", "model.foundation.mrope_section")):
        with pytest.raises((ConfigError, ValueError), match=rf"model.fused_qkv_rope=true cannot be combined with {what}"):
            validate(to_config(compose_config(on, f"model={model}")), world_size=1)
