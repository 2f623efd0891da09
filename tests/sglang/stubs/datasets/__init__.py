"""A stand-in for Hugging Face ``datasets`` in the SGLang test environment: SGLang's own
unified-radix-cache test kit imports ``sglang.test.test_utils``, which imports SGLang's
benchmark datasets module, which imports ``datasets`` (and ~300 MB of pyarrow and pandas
with it). Nothing the tests run loads a data set; using the stand-in raises."""

from __future__ import annotations


def _unavailable(*args, **kwargs):
    raise RuntimeError("datasets is a test stub here (tests/sglang/stubs)")


load_dataset = _unavailable


def __getattr__(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _unavailable
