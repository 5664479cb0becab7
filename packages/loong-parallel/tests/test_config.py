import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from loong_parallel import OptimConfig, ParallelConfig


def test_data_parallel_size_is_derived():
    assert ParallelConfig(tp=2, pp=2).data_parallel_size(8) == 2
    with pytest.raises(
        ValueError, match=r"world size 6 is not divisible by parallel.tp \* parallel.pp \* parallel.cp = 4 \* 1 \* 1"
    ):
        ParallelConfig(tp=4).data_parallel_size(6)


@pytest.mark.parametrize(
    "pcfg, message",
    [
        (ParallelConfig(tp=0), r"parallel.tp=0 must be >= 1"),
        (ParallelConfig(tp=3), r"parallel.tp=3 must divide the attention heads \(32\) and KV groups \(8\)"),
        (ParallelConfig(pp=3), r"3 stages must divide the model's 16 layers"),
        (ParallelConfig(pp=2, vpp=3), r"parallel.pp=2 x parallel.vpp=3 = 6 stages"),
        (ParallelConfig(vpp=2), r"parallel.vpp=2 needs parallel.pp >= 2"),
        (ParallelConfig(sequence_parallel=True), r"sequence_parallel=true needs parallel.tp > 1"),
        (ParallelConfig(overlap_param_gather=True), r"needs parallel.distributed_optimizer=true"),
    ],
)
def test_layouts_that_cannot_hold_the_model_name_the_key(pcfg, message):
    with pytest.raises(ValueError, match=message):
        pcfg.validate(world_size=24, num_layers=16, num_heads=32, num_query_groups=8)


def test_valid_layout_passes():
    ParallelConfig(tp=2, pp=2, vpp=2, sequence_parallel=True).validate(8, 16, 32, 8)


@pytest.mark.parametrize(
    "ocfg, message",
    [
        (OptimConfig(min_lr=1.0), "must be in"),
        (OptimConfig(warmup_steps=-1), r"optim.warmup_steps=-1 must be >= 0"),
        (OptimConfig(state_dtype="bf16"), r"optim.state_dtype=bf16 needs optim.precision_aware=true"),
        (OptimConfig(offload_fraction=1.5, precision_aware=True), r"optim.offload_fraction=1.5 must be in \[0, 1\]"),
        (OptimConfig(offload_fraction=0.5), r"optim.offload_fraction=0.5 needs optim.precision_aware=true"),
        (OptimConfig(offload_fraction=0.5, precision_aware=True, state_dtype="bf16", offload_update="host"),
         r"optim.offload_fraction=0.5 with optim.state_dtype=bf16 needs optim.offload_update=device"),
        (OptimConfig(host_threads=0), r"optim.host_threads=0 must be >= 1 or null \(automatic\)"),
        (OptimConfig(offload_master="remainder"), r"optim.offload_master=remainder needs optim.offload_fraction > 0 "
                                                  r"\(it is 0.0\) and optim.offload_update=device"),
        (OptimConfig(offload_master="remainder", precision_aware=True, offload_fraction=1.0, offload_update="host"),
         r"optim.offload_master=remainder needs .* optim.offload_update=device \(it is host\)"),
    ],
)
def test_bad_optimizer_settings(ocfg, message):
    with pytest.raises(ValueError, match=message):
        ocfg.validate()


def test_masters_kept_as_low_halves_need_bf16_weights():
    import torch

    from loong_parallel.optimizer import build_optimizer

    ocfg = OptimConfig(precision_aware=True, offload_fraction=1.0, offload_master="remainder")
    with pytest.raises(ValueError, match=r"optim.offload_master=remainder needs bf16 weights \(train.dtype=bf16\); "
                                         r"the weights are torch.float16"):  # fmt: skip
        build_optimizer(ocfg, ParallelConfig(distributed_optimizer=True), [], dtype=torch.float16, total_steps=1)


MOE = dict(num_experts=8, expert_ffn_hidden_size=32, has_shared_experts=False)


@pytest.mark.parametrize(
    "pcfg, world, moe, message",
    [
        (ParallelConfig(ep=2), 4, {}, r"parallel.ep is set but the model has no experts"),
        (ParallelConfig(etp=1), 4, {}, r"parallel.etp is set but the model has no experts"),
        (ParallelConfig(ep=0), 4, MOE, r"parallel.ep=0 must be >= 1"),
        (ParallelConfig(ep=3), 6, MOE, r"parallel.ep=3 must divide the model's 8 experts"),
        (ParallelConfig(ep=2, etp=3), 6, MOE, r"parallel.etp=3 must divide the experts' ffn_hidden_size \(32\)"),
        (ParallelConfig(ep=4, pp=2), 4, MOE,
         r"world size 4 is not divisible by parallel.etp x parallel.ep x parallel.pp = 1 x 4 x 2 = 8"),
        (ParallelConfig(ep=2, tp=2), 2, MOE, r"parallel.etp x parallel.ep x parallel.pp = 2 x 2 x 1 = 4 \(etp defaults"),
        (ParallelConfig(ep=2, tp=2, etp=1), 2, MOE, r"parallel.ep > 1 with parallel.tp > 1 needs parallel.sequence_parallel=true"),
        (ParallelConfig(moe_shared_expert_overlap=True), 1, MOE, r"moe_shared_expert_overlap=true but the model has no shared"),
        (ParallelConfig(moe_shared_expert_overlap=True, moe_token_dispatcher="allgather"), 1,
         {**MOE, "has_shared_experts": True}, r"moe_shared_expert_overlap=true needs parallel.moe_token_dispatcher=alltoall"),
        (ParallelConfig(moe_a2a_overlap=True), 1, MOE, r"moe_a2a_overlap=true needs parallel.ep >= 2"),
        (ParallelConfig(moe_a2a_overlap=True, ep=2, pp=2), 4, MOE, r"moe_a2a_overlap=true with parallel.pp > 1 needs parallel.vpp"),
        (ParallelConfig(offload_activations=["attn_proj"]), 1, MOE, r"'attn_proj' needs 'core_attn' too"),
        (ParallelConfig(ep=2, moe_delay_wgrad=True), 2, MOE, r"moe_delay_wgrad=true needs parallel.moe_a2a_overlap=true"),
        (ParallelConfig(ep=2, moe_a2a_overlap=True, moe_delay_wgrad=True, grad_accumulation="batched"), 2, MOE,
         r"moe_delay_wgrad=true cannot be combined with parallel.grad_accumulation=batched"),
        (ParallelConfig(ep=2, moe_delay_wgrad=True), 2, {}, r"parallel.moe_delay_wgrad is set but the model has no experts"),
    ],
)  # fmt: skip
def test_moe_layouts_that_cannot_work_name_the_key(pcfg, world, moe, message):
    with pytest.raises(ValueError, match=message):
        pcfg.validate(world, 16, 32, 8, **moe)


def test_valid_moe_layouts_pass():
    ParallelConfig(ep=2, tp=2, etp=1, sequence_parallel=True).validate(
        2, 16, 32, 8, **MOE
    )  # experts: 2 (ep) x 1 dp; dense: 2 (tp)
    ParallelConfig(ep=2, pp=2, vpp=2, moe_a2a_overlap=True).validate(4, 16, 32, 8, **MOE)
    ParallelConfig(ep=2, moe_a2a_overlap=True, moe_delay_wgrad=True).validate(2, 16, 32, 8, **MOE)
    ParallelConfig(ep=8, tp=1).validate(8, 16, 32, 8, **MOE)


def test_cuda_only_moe_options_are_refused_on_the_host():
    import torch

    from loong_parallel import runtime_transformer_fields

    for pcfg in (ParallelConfig(ep=2, moe_a2a_overlap=True), ParallelConfig(offload_activations=["moe_act"])):
        with pytest.raises(ValueError, match=r"needs CUDA \(device type here: cpu\)"):
            runtime_transformer_fields(pcfg, dtype=torch.float32, device_type="cpu")
    with pytest.raises(ValueError, match=r"moe_a2a_overlap=true needs train.dtype bf16 or fp16"):
        runtime_transformer_fields(
            ParallelConfig(ep=2, moe_a2a_overlap=True), dtype=torch.float32, device_type="cuda"
        )
    fields = runtime_transformer_fields(
        ParallelConfig(ep=2, tp=2, etp=1), dtype=torch.float32, device_type="cpu"
    )
    assert (fields["expert_model_parallel_size"], fields["expert_tensor_parallel_size"]) == (2, 1)


def test_delayed_weight_gradients_become_megatrons_field_which_megatron_accepts_with_the_a2a_overlap():
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loong_parallel import runtime_transformer_fields

    pcfg = ParallelConfig(ep=2, moe_a2a_overlap=True, moe_delay_wgrad=True)
    fields = runtime_transformer_fields(pcfg, dtype=torch.bfloat16, device_type="cuda")
    assert fields["delay_wgrad_compute"] and fields["overlap_moe_expert_parallel_comm"]
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=4,
                 moe_router_topk=2, moe_ffn_hidden_size=64)  # fmt: skip
    assert TransformerConfig(**fields, **shape).delay_wgrad_compute  # megatron's own checks pass
    plain = runtime_transformer_fields(ParallelConfig(ep=2), dtype=torch.bfloat16, device_type="cuda")
    assert not plain["delay_wgrad_compute"]


def test_delayed_weight_gradients_tell_megatrons_ddp_to_hook_the_modules_backward_dw():
    # without it DDP hooks the weights' AccumulateGrad nodes, which run before backward_dw has
    # computed anything: megatron's DDP reads its own delay_wgrad_compute, not the layers'
    from loong_parallel.model import ddp_config_for

    assert ddp_config_for(ParallelConfig(ep=2, moe_a2a_overlap=True, moe_delay_wgrad=True)).delay_wgrad_compute
    assert not ddp_config_for(ParallelConfig(ep=2, moe_a2a_overlap=True)).delay_wgrad_compute


def test_optimizer_offload_becomes_megatrons_host_offload_with_overlapped_copies():
    import torch

    from loong_parallel.optimizer import optimizer_config_for

    pcfg = ParallelConfig(distributed_optimizer=True)
    ocfg = OptimConfig(precision_aware=True, offload_fraction=0.5)
    ocfg.validate()
    config = optimizer_config_for(ocfg, pcfg, torch.bfloat16)  # megatron's own __post_init__ checks pass
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 0.5
    assert config.overlap_cpu_optimizer_d2h_h2d and config.use_precision_aware_optimizer
    assert config.decoupled_weight_decay  # megatron's host offload runs AdamW only
    plain = optimizer_config_for(OptimConfig(), pcfg, torch.bfloat16)
    assert not plain.optimizer_cpu_offload


def test_bf16_moments_of_an_offloaded_state_are_kept_by_the_device_update_not_megatron():
    import torch

    from loong_parallel.optimizer import _precision_aware_fields, optimizer_config_for

    pcfg = ParallelConfig(distributed_optimizer=True)
    ocfg = OptimConfig(precision_aware=True, offload_fraction=1.0, state_dtype="bf16")  # offload_update=device
    ocfg.validate()
    # megatron's hybrid optimizer and its checkpoint buffers keep fp32; the offloaded share's host
    # moments are bf16 by loong_xpu.offload_device_update (build_optimizer marks it so)
    config = optimizer_config_for(ocfg, pcfg, torch.bfloat16)
    assert config.exp_avg_dtype == config.exp_avg_sq_dtype == torch.float32
    # all on the GPU: megatron's own (TE's FusedAdam) moments in bf16 (megatron's config checks
    # for TE, which this machine may lack: the fields it is built from)
    on_gpu = _precision_aware_fields(OptimConfig(precision_aware=True, state_dtype="bf16"))
    assert on_gpu["exp_avg_dtype"] == on_gpu["exp_avg_sq_dtype"] == torch.bfloat16


OFFLOAD = dict(precision_aware=True, offload_fraction=1.0, offload_update="host")
HOST = dict(affinity=64, parent_affinity=64, local_world_size=4)  # an unbound process of 4 on 64 CPUs


@pytest.mark.parametrize(
    "ocfg, host, omp, threads",
    [
        (OptimConfig(), HOST, None, None),  # nothing offloaded: the thread count is left alone
        (OptimConfig(**dict(OFFLOAD, offload_update="device")), HOST, "1", None),  # no host update: left alone
        (OptimConfig(**OFFLOAD), HOST, "1", 16),  # torchrun's 1: the process's share of the host
        (OptimConfig(**OFFLOAD), HOST, None, 16),
        (OptimConfig(**OFFLOAD), dict(HOST, local_world_size=1), None, 64),
        (OptimConfig(**OFFLOAD), dict(HOST, local_world_size=128), None, 1),
        (OptimConfig(**OFFLOAD), HOST, "8", 8),  # a user's OMP_NUM_THREADS > 1 holds
        (OptimConfig(**OFFLOAD), dict(HOST, affinity=12), "1", 12),  # bound (numa-binding): its own CPUs
        # a container's CPU set (os.cpu_count() sees the whole machine) limits the launcher too
        (OptimConfig(**OFFLOAD), dict(HOST, affinity=16, parent_affinity=16), None, 4),
        (OptimConfig(**OFFLOAD, host_threads=3), HOST, "8", 3),  # the key wins
    ],
)
def test_the_host_update_of_an_offloaded_optimizer_gets_the_processs_share_of_the_cpus(ocfg, host, omp, threads):
    from loong_parallel.optimizer import host_threads_for

    ocfg.validate()
    assert host_threads_for(ocfg, **host, omp_num_threads=omp) == threads


def test_a_process_launched_with_one_omp_thread_gets_its_share_for_the_host_update():
    """In a fresh process as torchrun starts it (OMP_NUM_THREADS=1), the optimizer build's thread
    setting (megatron's offload needs CUDA, so the setting is called by itself here)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from loong_parallel.optimizer import OptimConfig, _set_host_threads; "
            "_set_host_threads(OptimConfig(precision_aware=True, offload_fraction=1.0, offload_update='host')); "
            "print(torch.get_num_threads())")  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == len(os.sched_getaffinity(0))  # launched by this (unbound) process


@pytest.mark.parametrize(
    "cls, fields, allowed",
    [
        (OptimConfig, {"schedule": "step"}, "cosine, linear, constant"),
        (ParallelConfig, {"moe_token_dispatcher": "flex"}, "alltoall, allgather"),
        (ParallelConfig, {"offload_activations": ["mlp"]}, "attn_norm, qkv_linear, core_attn"),
    ],
)
def test_choices_from_a_config_name_the_allowed_values(cls, fields, allowed):
    with pytest.raises(ValidationError, match=rf"expected one of \[{allowed}"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), fields))
