"""Settings for every test of the repository (each package's fixtures live in its own tests/)."""

import os

import torch

# CI has 2 cores and runs 2 xdist workers: torch's default of one thread per core in each worker
# oversubscribes them (loong-models' tests took 1.2x longer). One thread per worker, and for the
# processes the tests start (launch_env sets the same); set OMP_NUM_THREADS to choose otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
