"""A model kind defined only in this test trains through the unchanged Trainer: its own module,
forward step, FLOP count and description plug in through ``loong_parallel.ModelKind``."""

from __future__ import annotations

import json
import socket
from functools import partial

import pytest
import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_parallel import ParallelConfig, masked_token_loss, runtime_transformer_fields
from loong_train.main import to_config
from loong_train.testing import compose_config
from loong_train.trainer import Trainer

VOCAB, WIDTH = 8192, 32


class BigramMLP(MegatronModule):
    """Not a transformer: each token's next-token distribution from its own embedding only."""

    model_type = ModelType.encoder_or_decoder  # megatron's schedules read it

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, VOCAB))  # fmt: skip

    def set_input_tensor(self, tensor) -> None:  # megatron's schedules call it (no pipeline here)
        pass

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.embed(tokens)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")


class BigramKind:
    """The ModelKind of BigramMLP; counts its forward steps to prove the trainer used them."""

    backend = "torch"

    def __init__(self):
        self.forward_calls = 0

    def transformer_config(self, parallel: ParallelConfig, *, dtype, device_type) -> TransformerConfig:
        # only what megatron's DDP, optimizer and schedules read
        return TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1,
                                 **runtime_transformer_fields(parallel, dtype=dtype, device_type=device_type))  # fmt: skip

    def provider(self, config, parallel, *, device_type):
        return lambda pre_process, post_process, vp_stage: BigramMLP(config)

    def forward_step(self, device):
        return partial(self._forward, device)

    def _forward(self, device, data_iterator, model, return_schedule_plan=False):
        self.forward_calls += 1
        batch = next(data_iterator)
        loss = model(batch["tokens"].to(device), batch["labels"].to(device))
        return loss, partial(masked_token_loss, batch["loss_mask"].to(device))

    def flops(self, counts, *, seq_length: int) -> float:
        return 6.0 * (WIDTH * 4 * WIDTH + 4 * WIDTH * VOCAB) * counts.tokens

    def cost_shape(self) -> dict[str, int]:
        return dict(num_parameters=VOCAB * WIDTH, num_layers=1, attention_width=0)

    def step_stats(self, chunks, config, device):
        return None

    def describe(self) -> str:
        return "bigram MLP (defined in a test)"


@pytest.fixture
def single_process(monkeypatch):
    """A world of one in this process; the variables go when the test ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), LOONG_DEVICE="cpu").items():  # fmt: skip
        monkeypatch.setenv(key, value)


def test_a_model_kind_defined_only_in_a_test_trains_through_the_trainer(single_process, tmp_path, data_cache):
    overrides = ["data.seq_length=32", "train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=8",
                 "train.eval_iters=1", "train.eval_interval=4", "train.tensorboard=false", "train.progress=false",
                 "train.device=cpu", "optim.lr=1e-2", "optim.warmup_steps=0", f"data.cache_dir={data_cache}",
                 f"train.output_dir={tmp_path}"]  # fmt: skip
    cfg = to_config(compose_config(*overrides))
    kind = BigramKind()
    summary = Trainer(cfg, model=kind).fit()

    assert summary.last_loss < summary.first_loss - 0.5, (summary.first_loss, summary.last_loss)
    # 8 steps x 2 micro-batches, plus one held-out micro-batch at step 4 and at the end
    assert kind.forward_calls == 8 * 2 + 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split", "train") == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in records if r.get("split") == "val"] == [4, 8]
    assert (summary.checkpoint / "loong.json").is_file()  # the kind's module saved like any other
