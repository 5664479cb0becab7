"""megatron-core's own GPTModel, DDP, optimizer and schedule, on the CPU through loong-xpu alone.
Run by test_megatron_on_cpu.py (also under torchrun for TP=2); prints the losses."""

import os
import sys

import torch
import torch.distributed as dist

from loong_xpu import get_accelerator, redirect_cuda

with redirect_cuda(get_accelerator("cpu")):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo")
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    mpu.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3), [model])
    data = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))

    def forward_step(it, model):
        b = next(it)
        out = model(b[:, :-1], torch.arange(32).expand(4, -1), None, labels=b[:, 1:])
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    for _ in range(20):
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([data]), model=[model],
            num_microbatches=1, seq_length=32, micro_batch_size=4,
        )  # fmt: skip
        opt.step()
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"loss {losses[0]['loss'].item():.6f}", flush=True)
    dist.destroy_process_group()
