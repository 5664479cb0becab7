from loong_xpu.testing import megatron_cpu, megatron_cuda  # noqa: F401  (fixtures: a one-process megatron world on the CPU / GPU)
