"""Fixtures of the vLLM integration tests: a tiny model, a real coordinator sized for it.

Importing vllm here would break collection in the default venv, so everything that needs
vllm is imported inside the fixtures (and the test modules skip themselves, see
``vllm_env``).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def tiny_model():
    from vllm_harness import TinyModel

    return TinyModel()


@pytest.fixture
def model_dir(tiny_model, tmp_path):
    return tiny_model.write(tmp_path / "tiny-llama")


@pytest.fixture
def start_coordinator(tiny_model, instance_name, tmp_path):
    """``start(num_chunks=64, suffix="", **kw)`` -> a running CoordinatorProcess; all are
    stopped and cleaned up after the test."""
    from tiercache.service.process import CoordinatorProcess

    started = []

    def start(num_chunks: int = 64, suffix: str = "", **kw):
        config = tiny_model.coordinator_config(f"{instance_name}{suffix}",
                                               str(tmp_path / f"c{suffix}.sock"), num_chunks, **kw)
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
def make_engine(tiny_model, model_dir):
    """``make(coordinator, **kw)`` -> a harness Engine; shut down after the test."""
    from vllm_harness import Engine

    engines = []

    def make(coordinator, **kw):
        engine = Engine.build(tiny_model, kw.pop("model_dir", model_dir),
                              coordinator.config_path, **kw)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
