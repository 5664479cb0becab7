"""parallel.grad_accumulation=batched: without megatron's per-parameter hooks the gradients wait in
``param.grad`` and reach DDP's ``main_grad`` in one multi-tensor add per micro-batch; the training
step's results are the hooks' own, bit for bit."""

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config
from loong_parallel import OptimConfig, ParallelConfig, build_model_chunks, build_optimizer, train_step
from loong_parallel.grad_accumulation import flush_grads
from loong_parallel.step import LOSS_KEY
from loong_xpu import get_accelerator

SEQ, VOCAB = 8, 128


def _build(accumulation: str):
    f = FoundationConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, vocab_size=VOCAB
    )
    config = build_transformer_config(f, use_cpu_initialization=True)
    pcfg = ParallelConfig(grad_accumulation=accumulation)
    torch.manual_seed(0)
    chunks = build_model_chunks(
        lambda pre, post, vp: build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu"),
        pcfg, config, get_accelerator("cpu"),
    )  # fmt: skip
    optimizer, scheduler = build_optimizer(OptimConfig(warmup_steps=0, lr=1e-2), pcfg, chunks,
                                           dtype=torch.float32, total_steps=10)  # fmt: skip
    return chunks, optimizer, scheduler


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    out = model(tokens, torch.arange(SEQ).unsqueeze(0), None, labels=tokens.roll(-1, dims=1))

    def loss(per_token):
        s, n = per_token.float().sum(), torch.tensor(per_token.numel())
        return s, n.int(), {LOSS_KEY: torch.stack([s.detach(), n.float()])}

    return out, loss


def _train(accumulation: str, steps: int = 2):
    chunks, optimizer, scheduler = _build(accumulation)
    g = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        micro = iter([torch.randint(0, VOCAB, (1, SEQ), generator=g) for _ in range(3)])
        results.append(train_step(_forward_step, micro, chunks, optimizer, scheduler, num_microbatches=3,
                                  seq_length=SEQ, micro_batch_size=1, device=torch.device("cpu")))  # fmt: skip
    return chunks, results


def test_batched_accumulation_trains_bit_for_bit_as_megatrons_hooks(megatron_cpu):
    hooked, ref = _train("hooks")
    chunks, got = _train("batched")
    assert [r.loss for r in got] == [r.loss for r in ref] and [r.grad_norm for r in got] == [
        r.grad_norm for r in ref
    ]
    params = [p for p in chunks[0].parameters() if p.requires_grad]
    assert all(
        torch.equal(a, b) for a, b in zip(params, [p for p in hooked[0].parameters() if p.requires_grad])
    )
    # every gradient was flushed into main_grad (megatron's fp32 optimizer then points .grad at it)
    assert all(p.grad is None or p.grad is p.main_grad for p in params)


def test_without_the_hooks_a_backward_leaves_the_gradients_in_param_grad_until_flushed(megatron_cpu):
    chunks, _, _ = _build("batched")
    chunks[0].zero_grad_buffer()
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    out, loss = _forward_step(iter([tokens]), chunks[0])
    loss(out)[0].backward()
    params = [p for p in chunks[0].parameters() if p.requires_grad]
    assert all(p.grad is not None for p in params)  # no hook took them
    assert all(not p.main_grad.any() for p in params)
    grads = [p.grad.clone() for p in params]
    flush_grads(chunks)
    assert all(p.grad is None and torch.equal(p.main_grad, g) for p, g in zip(params, grads))


@pytest.mark.parametrize("change", ["one hooked elsewhere", "no grad_accs"])
def test_a_megatron_ddp_that_keeps_its_hooks_otherwise_fails_naming_the_patch(megatron_cpu, change):
    """Dropping the hooks rests on megatron's DDP keeping one hooked AccumulateGrad node per
    parameter in grad_accs (loong_xpu's patch): a DDP that does not stops with one line naming the
    patch and keeps its hooks."""
    from loong_parallel.grad_accumulation import batch_grad_accumulation, batched

    chunks, _, _ = _build("hooks")
    if change == "no grad_accs":
        del chunks[0].grad_accs
        found = "no grad_accs list"
    else:
        chunks[0].grad_accs.pop()
        found = rf"{len(chunks[0].grad_accs)} entries for {len(chunks[0].grad_accs) + 1} parameters"
    with pytest.raises(RuntimeError, match=r"^loong_xpu patch megatron.core.distributed.distributed_data_parallel:"
                                           r"DistributedDataParallel.loong_drop_grad_accumulation_hooks: megatron-core's "
                                           rf".* in grad_accs \({found}\); parallel.grad_accumulation=batched"):  # fmt: skip
        batch_grad_accumulation(chunks[0])
    assert not batched(chunks) and len(getattr(chunks[0], "grad_accs", [None])) > 0


def test_batched_accumulation_refuses_overlapped_reduction_and_pipeline_stages():
    with pytest.raises(ValueError, match="parallel.grad_accumulation=batched .*overlap_grad_reduce=false"):
        ParallelConfig(grad_accumulation="batched", overlap_grad_reduce=True).validate(1, 2, 2, 2)
    with pytest.raises(ValueError, match="parallel.pp=1"):
        ParallelConfig(grad_accumulation="batched", pp=2).validate(2, 2, 2, 2)
