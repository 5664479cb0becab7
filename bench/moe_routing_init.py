"""Where an MoE model's routers send real text at initialisation, per layer: the busiest expert's
tokens over the mean (expert imbalance) and the busiest expert-parallel rank's over the mean rank's
(EP imbalance, the share that makes the other ranks wait in the all-to-all), against uniformly
drawn tokens of the same vocabulary. One forward pass on the CPU, no GPU needed.

    python bench/moe_routing_init.py                           # qwen3-30b-a3b x 4 layers, EP 2 / 4 / 8
    python bench/moe_routing_init.py --model qwen3-moe-tiny --seq 256 --ep 2

Real text is Zipfian and, at initialisation, each token's embedding dominates its router input
(loong-models' embedding_init_std), so frequent tokens pile onto their experts: at the default
shape the expert imbalance is ~3-4 on Shakespeare against ~1.3 for uniform tokens, while the EP
ranks, each holding a contiguous block of experts, stay within ~1.15 of each other.
"""

from __future__ import annotations

import argparse
import random

import torch

from loong_data import default_corpus, default_tokenizer, load_tokenizer
from loong_models import ModelConfig, build_model, build_transformer_config, load_model_config
from loong_parallel.moe import ep_load_imbalance
from loong_xpu import get_accelerator
from loong_xpu.testing import megatron_world


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept from the model's shape")
    p.add_argument("--seq", type=int, default=4096, help="tokens of the one sequence routed")
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8], help="expert-parallel sizes to report")
    p.add_argument("--seed", type=int, default=0, help="initial weights and the text's offset")
    args = p.parse_args(argv)
    experts = load_model_config(args.model).foundation.moe
    if experts is None:
        p.error(f"--model {args.model} has no moe: config")
    for ep in args.ep:
        if experts.num_experts % ep:
            p.error(f"--ep {ep} must divide the model's {experts.num_experts} experts")
    return args


def text_tokens(seq: int, seed: int) -> tuple[torch.Tensor, int]:
    """``seq`` tokens of the bundled corpus (the bundled tokenizer, as the train app's default data)
    from a seeded offset, and the tokenizer's vocabulary size."""
    tok = load_tokenizer(default_tokenizer())
    works = sorted(p for p in default_corpus().glob("*.txt"))
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < seq:
        text = rng.choice(works).read_text(encoding="utf-8")
        start = rng.randrange(max(len(text) - 40 * seq, 1))
        ids += tok.encode(text[start : start + 40 * seq])
    return torch.tensor(ids[:seq]), tok.vocab_size


def routed_counts(model: torch.nn.Module, tokens: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, one row per MoE layer, for one forward pass of ``tokens``."""
    rows: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: rows.append(out[1].reshape(-1, num_experts).sum(0).double()))
             for m in model.modules() if type(m).__name__ == "TopKRouter"]  # fmt: skip
    try:
        with torch.no_grad():
            model(tokens[None], torch.arange(len(tokens))[None], None)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(rows)


def imbalance_rows(counts: torch.Tensor, eps: list[int]) -> dict[str, list[float]]:
    """Per layer: the expert imbalance and, for each EP size, the EP ranks' imbalance."""
    out = {"experts": [float(c.max() / c.mean()) for c in counts]}
    for ep in eps:
        out[f"EP {ep} ranks"] = ep_load_imbalance(counts, ep).tolist()
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    args = parse_args(argv)
    cfg = load_model_config(args.model, [f"foundation.num_layers={args.layers}"])
    num_experts = cfg.foundation.moe.num_experts
    text, vocab = text_tokens(args.seq, args.seed)
    if vocab > cfg.foundation.vocab_size:
        raise SystemExit(f"the bundled tokenizer's {vocab} tokens do not fit --model {args.model}'s "
                         f"vocab_size={cfg.foundation.vocab_size}")  # fmt: skip
    uniform = torch.randint(0, vocab, (args.seq,), generator=torch.Generator().manual_seed(args.seed))
    results = {}
    with megatron_world(get_accelerator("cpu")):
        config = build_transformer_config(cfg.foundation, use_cpu_initialization=True,
                                          moe_token_dispatcher_type="alltoall")  # fmt: skip
        torch.manual_seed(args.seed)
        model = build_model(
            ModelConfig(foundation=cfg.foundation, layer_backend="local"), config, device_type="cpu"
        )
        for name, tokens in (("real text", text), ("uniform tokens", uniform)):
            results[name] = imbalance_rows(routed_counts(model, tokens, num_experts), args.ep)
    print(f"{args.model} x {args.layers} layers, {num_experts} experts top-{cfg.foundation.moe.router_topk}, "
          f"one sequence of {args.seq} tokens, seed {args.seed}: busiest / mean, per MoE layer")  # fmt: skip
    for name, rows in results.items():
        for what, values in rows.items():
            print(f"  {name:<15} {what:<12} {' '.join(f'{v:5.2f}' for v in values)}")
    return results


if __name__ == "__main__":
    main()
