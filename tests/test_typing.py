"""The type checking ``make lint`` runs (pyproject.toml's ``[tool.mypy]``), as mypy itself
reads it: every module of the foundation, the index, eviction and planning is checked with
every per-module flag of ``--strict``; the rest in default mode (a per-module
``strict = true`` would switch strict on for every module); third-party modules without
types are named one by one; and every ``# type: ignore`` names its error code and why."""

from __future__ import annotations

import os
import re

import pytest
from mypy.main import process_options
from mypy.options import PER_MODULE_OPTIONS, Options

from house import GROUPS, LAYERS, PACKAGE

ROOT = PACKAGE.parent
STRICT_LAYERS = [*GROUPS["foundation"], "eviction", "index", "planning"]
DEFAULT_LAYERS = [layer for layer in LAYERS if layer not in STRICT_LAYERS]
IGNORE = re.compile(r"# type: ignore(?P<code>\[[a-z-]+(, *[a-z-]+)*\])?(?P<rest>.*)$")


def _explained(line: str) -> bool | None:
    """None: no ``type: ignore`` on the line; else whether it has [codes] and ``# why``."""
    found = IGNORE.search(line)
    if found is None:
        return None
    return bool(found["code"]) and re.match(r"\s+#\s*\S", found["rest"]) is not None


def _options(*args: str) -> Options:
    saved = os.environ.get("MYPY_CONFIG_FILE_DIR")  # process_options sets it
    try:
        return process_options(list(args))[1]
    finally:
        if saved is None:
            os.environ.pop("MYPY_CONFIG_FILE_DIR", None)
        else:
            os.environ["MYPY_CONFIG_FILE_DIR"] = saved


@pytest.fixture(scope="module")
def configured() -> Options:
    return _options("--config-file", str(ROOT / "pyproject.toml"))


@pytest.fixture(scope="module")
def strict_flags() -> dict[str, object]:
    """What ``--strict`` changes, per module, by mypy's own definition of it."""
    plain = _options("--config-file", "", "x.py")
    strict = _options("--config-file", "", "--strict", "x.py")
    flags = {name: getattr(strict, name) for name in PER_MODULE_OPTIONS
             if getattr(strict, name) != getattr(plain, name)}
    assert "disallow_untyped_defs" in flags  # mypy's --strict is still what we read
    return flags


def _modules(layer: str) -> list[str]:
    if (PACKAGE / f"{layer}.py").exists():
        return [f"tiercache.{layer}"]
    return [".".join(("tiercache", *p.relative_to(PACKAGE).with_suffix("").parts))
            .removesuffix(".__init__") for p in sorted((PACKAGE / layer).rglob("*.py"))]


def test_the_typed_layers_are_checked_with_every_strict_flag(configured, strict_flags):
    loose = {}
    for layer in STRICT_LAYERS:
        for module in _modules(layer):
            options = configured.clone_for_module(module)
            missing = [n for n, v in strict_flags.items() if getattr(options, n) != v]
            if missing:
                loose[module] = missing
    assert not loose, f"not checked strictly (pyproject.toml [[tool.mypy.overrides]]): {loose}"


def test_the_other_layers_are_checked_in_default_mode(configured, strict_flags):
    """A per-module ``strict = true`` sets the flags for every module: this is how it shows."""
    for layer in DEFAULT_LAYERS:
        for module in _modules(layer):
            options = configured.clone_for_module(module)
            assert not (options.disallow_untyped_defs or options.check_untyped_defs), \
                f"{module}: checked strictly (a per-module strict = true sets it for all)"


def test_untyped_imports_are_allowed_one_module_at_a_time(configured):
    assert configured.python_version == (3, 11)
    assert configured.files == ["tiercache"]
    assert not configured.ignore_missing_imports  # a new untyped import is an error
    assert not configured.clone_for_module("tiercache.tiers.mooncake_pool").ignore_missing_imports
    for module in ("mooncake.store", "posix_ipc", "vllm.v1.kv_offload.base", "triton.language",
                   "sglang.srt.mem_cache.hicache_storage"):
        assert configured.clone_for_module(module).ignore_missing_imports, module


def test_every_type_ignore_names_its_error_code_and_a_reason():
    bare = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if _explained(line) is False]
    assert not bare, "a type: ignore without [code] and a '# why' after it:\n" + "\n".join(bare)


def test_the_ignore_check_tells_bare_from_explained():
    assert _explained("x = 1  # type: ignore[assignment]  # released: a later use fails")
    assert _explained("x = 1  # type: ignore[arg-type, union-attr]  # why")
    assert _explained("x = 1  # nothing ignored here") is None
    for bare in ("x = 1  # type: ignore", "x = 1  # type: ignore  # no code",
                 "x = 1  # type: ignore[assignment]", "x = 1  # type: ignore[assignment]  #"):
        assert _explained(bare) is False, bare


def test_the_layers_name_every_module():
    assert _modules("errors") == ["tiercache.errors"]
    region = _modules("region")
    assert "tiercache.region" in region and "tiercache.region.shm" in region
    named = {m for layer in LAYERS for m in _modules(layer)}
    on_disk = {".".join(("tiercache", *p.relative_to(PACKAGE).with_suffix("").parts))
               .removesuffix(".__init__") for p in PACKAGE.rglob("*.py")}
    assert on_disk - named == {"tiercache"}  # the package's own __init__ only
