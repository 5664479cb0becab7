"""Run under torchrun (gloo): DPBalancer on real process groups. Every sample of the global batch
arrives on exactly one rank, intact; the result is the same when run again; a rank may start
with no samples. Exits non-zero on any violation; prints OK on rank 0."""

import numpy as np
import torch
import torch.distributed as dist

from loong_parallel.balance import DPBalancer, QuadraticCost, field_specs


def make_sample(gid: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(gid)
    n = int(rng.integers(1, 40)) if gid % 7 else 400  # every 7th sample is long
    return {
        "tokens": torch.arange(gid * 1000, gid * 1000 + n, dtype=torch.int64),
        "patches": torch.full((n // 4 + 1, 3), float(gid)),  # a trailing dimension
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Uneven counts: rank 0 starts with nothing, the others with 6, 7, 8 ... samples.
    counts = [0] + [5 + r for r in range(1, world)]
    first = sum(counts[:rank])
    ids = list(range(first, first + counts[rank]))
    samples = [make_sample(i) for i in ids]
    sizes = np.array([[s["tokens"].shape[0], s["patches"].shape[0]] for s in samples]).reshape(-1, 2)
    spec = field_specs(make_sample(1))
    balancer = DPBalancer(QuadraticCost(1.0, 0.01), min_imbalance=0.0)

    mine, plan = balancer.balance(samples, sizes, spec)
    again, _ = balancer.balance(samples, sizes, spec)
    assert [i for i, _ in mine] == [i for i, _ in again], "not deterministic"
    assert plan.skipped is None and plan.imbalance < plan.naive_imbalance, plan
    assert [i for i, _ in mine] == sorted(np.flatnonzero(plan.assignment == rank).tolist())
    for gid, sample in mine:
        expected = make_sample(gid)
        assert all(torch.equal(sample[k], expected[k]) for k in expected), f"sample {gid} corrupted"

    everyone: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, [i for i, _ in mine])
    flat = sorted(i for ids_ in everyone for i in ids_)
    assert flat == list(range(sum(counts))), "a sample was lost or duplicated"

    # A cost that sees the patches column too (a VLM-style pluggable cost) also works.
    vlm_cost = lambda s: QuadraticCost(1.0, 0.01)(s) + 5.0 * s[:, 1]  # noqa: E731
    mine_vlm, plan_vlm = DPBalancer(vlm_cost, min_imbalance=0.0).balance(samples, sizes, spec)
    dist.all_gather_object(everyone, [i for i, _ in mine_vlm])
    assert sorted(i for ids_ in everyone for i in ids_) == list(range(sum(counts)))
    if rank == 0:
        print(f"OK imbalance {plan.naive_imbalance:.3f} -> {plan.imbalance:.3f}, "
              f"vlm {plan_vlm.naive_imbalance:.3f} -> {plan_vlm.imbalance:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
