"""Fixtures for the cross-package tests (helpers live in loong_train.testing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loong_train.testing import make_runner


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def runner_factory(data_cache):
    """For module-scoped fixtures: runner_factory(base_dir) -> runner."""
    return lambda base: make_runner(base, data_cache)


@pytest.fixture
def run_train(tmp_path, data_cache):
    return make_runner(tmp_path, data_cache)
