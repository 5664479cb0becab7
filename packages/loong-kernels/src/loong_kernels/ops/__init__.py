"""Autograd Functions and the public functions built on them; each calls :mod:`loong_kernels.dispatch`."""
