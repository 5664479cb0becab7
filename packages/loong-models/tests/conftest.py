from loong_xpu.testing import megatron_cpu  # noqa: F401  (a fixture: a one-process megatron world on the CPU)
