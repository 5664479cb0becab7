"""torchrun worker of test_autotune: each rank's own timings favour a different candidate (rank
0's "a" is the fast reference, rank 1's "a" is the query-by-query one); with the process group up,
both must run rank 0's choice; with megatron-core's parallel state at PP=2, each pipeline stage
(one rank each here) decides alone, with no collective across stages. Prints
``rank R [world|pp=2]: local X, chosen Y by Z``."""

import os
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from test_autotune import FAST, SLOW, _inputs

from loong_kernels.agreement import rel_diff
from loong_kernels.autotune import Autotuner
from loong_kernels.ops.dsa_tuning import sparse_mla_trial
from loong_xpu import get_accelerator
from loong_xpu.patches import redirect_cuda


def main() -> None:
    rank = int(os.environ["RANK"])
    args = _inputs()
    fast, slow = sparse_mla_trial(FAST, *args), sparse_mla_trial(SLOW, *args)
    steps = {"a": fast, "b": slow} if rank == 0 else {"a": slow, "b": fast}
    local = Autotuner(iters=5).pick("k", steps, reference="a", check=rel_diff, tol=1e-5)  # not distributed yet
    dist.init_process_group("gloo")
    try:
        tuner = Autotuner(iters=5)
        chosen = tuner.pick("k", steps, reference="a", check=rel_diff, tol=1e-5)
        report = [f"rank {rank} world: local {local}, chosen {chosen} by {tuner.cache['k'].decided_by}"]
        with redirect_cuda(get_accelerator("cpu")):
            mpu.initialize_model_parallel(1, 2)
            tuner = Autotuner(iters=5)
            chosen = tuner.pick("k", steps, reference="a", check=rel_diff, tol=1e-5)
            report.append(f"rank {rank} pp=2: local {local}, chosen {chosen} by {tuner.cache['k'].decided_by}")
            mpu.destroy_model_parallel()
        # a file per rank: two processes' lines on one stdout pipe can interleave
        Path(os.environ["AUTOTUNE_REPORT_DIR"], f"rank{rank}.txt").write_text("\n".join(report) + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
