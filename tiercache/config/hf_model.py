"""A model's Hugging Face ``config.json``, checked before an engine is asked about it
(``config-for-vllm``, ``config-for-sglang``): a missing file, a file that is not JSON or not
a decoder's config is one line naming the file, without loading vLLM or SGLang. The
geometry itself is the engine's answer (``vllm.model_kv``, ``sglang.model_pool``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.errors import ConfigError


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
