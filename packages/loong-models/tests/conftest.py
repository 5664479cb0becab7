pytest_plugins = ["loong_xpu.testing"]
