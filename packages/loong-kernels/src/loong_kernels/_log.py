import logging

logger = logging.getLogger("loong_kernels")
