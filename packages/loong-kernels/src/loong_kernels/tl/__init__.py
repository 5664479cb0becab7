"""TileLang kernels for CUDA (Hopper, sm_90a). Importing any module here imports ``tilelang``.

Each module offers the same functions as its reference in :mod:`loong_kernels.reference` plus
``supports*`` predicates, and ``build_*`` functions that compile a kernel for a target (used by
the CPU compile tests with ``tilelang_support.SM90_TARGET``).
"""
