"""Fixtures of the SGLang integration tests: a tiny KV shape, real coordinators sized for it,
and SGLang ranks (real HiCache controllers) in this process.

Importing sglang here would break collection in the default venv, so everything that needs
it is imported inside the fixtures (and the test modules skip themselves: ``sglang_env``).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def model():
    from sglang_harness import ModelSpec

    return ModelSpec()


@pytest.fixture
def start_coordinator(model, instance_name, tmp_path):
    """``start(suffix="", model=None, **config_fields)`` -> a running CoordinatorProcess
    sized for ``model`` (the fixture's by default); all are cleaned up after the test."""
    from tiercache.service.process import CoordinatorProcess

    started = []

    def start(suffix: str = "", spec=None, **fields):
        spec = spec or model
        config = spec.coordinator_config(f"{instance_name}{suffix}",
                                         str(tmp_path / f"c{suffix}.sock"), **fields)
        process = CoordinatorProcess(config, workdir=tmp_path / f"coord{suffix}")
        started.append(process)
        return process

    yield start
    for process in started:
        process.cleanup()


@pytest.fixture
def coordinator(start_coordinator):
    return start_coordinator()


@pytest.fixture
def make_rank(model):
    """``make(coordinator_or_config_path, **kw)`` -> an SGLangRank in this process; its
    storage backend is detached after the test."""
    from sglang_harness import SGLangRank

    ranks = []

    def make(target, **kw):
        path = getattr(target, "config_path", target)
        kw.setdefault("model", model)
        rank = SGLangRank(str(path), **kw)
        ranks.append(rank)
        return rank

    yield make
    for rank in ranks:
        rank.close()
