"""A model's Hugging Face ``config.json``, read once for the commands that size a
coordinator for an engine (``config-for-vllm``, ``config-for-sglang``): the decoder's
fields and its dtype. No engine import: this runs on the coordinator's host."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.config.sections import DTYPE_BYTES
from tiercache.errors import ConfigError

_TORCH_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16",
                 "float32": "float32", "float": "float32"}


@dataclass(frozen=True)
class HFModel:
    """``fields``: the decoder's config (``text_config`` of a multimodal wrapper)."""

    path: Path
    fields: dict[str, Any]

    @classmethod
    def read(cls, path: str) -> HFModel:
        """The config at ``path`` (a local model directory or its config.json); one
        ``ConfigError`` naming the file when it is missing, not JSON, or not a decoder."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            hf = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"model config {str(p)!r} does not exist (give a local model "
                              "directory or its config.json)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"model config {str(p)!r} is not JSON: {e}") from None
        hf = hf.get("text_config", hf)  # multimodal wrappers keep the decoder here
        missing = [k for k in ("num_hidden_layers", "num_attention_heads") if k not in hf]
        if missing:
            raise ConfigError(f"{p}: no {', '.join(missing)}; not a decoder config tiercache "
                              "can size")
        return cls(p, hf)

    @property
    def num_layers(self) -> int:
        return int(self.fields["num_hidden_layers"])

    @property
    def kv_heads_and_head_dim(self) -> tuple[int, int]:
        heads = self.fields["num_attention_heads"]
        head_dim = self.fields.get("head_dim") or self.fields["hidden_size"] // heads
        return int(self.fields.get("num_key_value_heads", heads)), int(head_dim)

    def dtype(self) -> str:
        """The model's own dtype as a KV dtype name; ``ConfigError`` when unknown."""
        name = str(self.fields.get("torch_dtype", self.fields.get("dtype", "bfloat16")))
        if name not in _TORCH_DTYPES:
            raise ConfigError(f"{self.path}: torch_dtype {self.fields.get('torch_dtype')!r}; "
                              "pass --kv-cache-dtype")
        return _TORCH_DTYPES[name]


@dataclass(frozen=True)
class KVShape:
    """A decoder's KV per layer and token, checked: ``num_kv_heads`` heads of ``head_dim``
    in ``kv_dtype``. Each engine adapter derives its pages from it (``vllm.geometry``,
    ``sglang.geometry``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.kv_dtype not in DTYPE_BYTES:
            raise ConfigError(f"kv dtype {self.kv_dtype!r}: allowed {', '.join(DTYPE_BYTES)}")
