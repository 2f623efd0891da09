"""Key namespaces of SGLang deployments, and the keys SGLang's page hashes become.

SGLang names a page by a SHA-256 chain over its token ids (64 hex digits; LoRA and
``cache_salt`` already seed the chain). Two SGLang deployments may exchange a page only
when everything that shapes its bytes is equal: the model and its weights, the KV dtype,
the host pool's memory layout (``page_first`` and ``page_first_direct`` have the same size
and different bytes), the page size, the parallel layout (TP size: each rank holds its
heads' shard; MLA: one replicated latent page), the bytes of each blob of a page, and
tiercache's key format. ``Namespace`` digests all of that into ``NAMESPACE_BYTES`` that
prefix every key, so deployments that differ in any of these never see each other's
pages, even on one coordinator, and never a vLLM engine's (whose namespaces digest other
fields under another engine name).

**Weights.** SGLang passes the served model name (by default its ``--model-path``, tagged
with the host pool's format tag). The same name or path can hold other weights tomorrow, so
the namespace also carries a fingerprint of what is at ``--model-path`` (the backend reads
it from SGLang's published server args; ``weights_fingerprint``): ``config.json``'s bytes
and, per weight file, its name, size and content identity (the blob's SHA-256 where the file
is a Hugging Face cache symlink, whose target is named by it; else its mtime). An operator
who serves other weights under an unchanged path without touching the files (a remote mount)
adds ``tiercache_namespace_salt``.

**Keys carry the rank.** ``page_key(hash, shard)``: digest | shard (u16) | hash. Every
TP rank of an MHA model stores its own shard of a page under its own key (shard =
``tp_rank``), so a rank never waits for the others and a page is whole exactly when every
rank's key is there: SGLang reduces each rank's hit count with MIN over its TP group before
it loads, so a page one rank lacks is a miss for all. MLA pages are the same on every rank:
one key (shard = ``dcp_rank``, 0 without decode context parallelism), written by SGLang's
designated writer and loaded by every rank. Why not one key per page, written by every
rank into its own slice: the cache index has one writer per slot (a session), and SGLang's
rank processes have no scheduler above them that could join their writes (vLLM's has).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from tiercache.errors import ArgumentError

NAMESPACE_BYTES = 16
KEY_FORMAT_VERSION = 1  # digest | shard u16 | hash kind u8 | hash bytes
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HASH_HEX, _HASH_TEXT = b"\x00", b"\x01"  # SGLang's 64-hex page hash, or any other string
MAX_HASH_BYTES = 200  # well inside the index's key bound (the ledger keeps 256 bytes)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two SGLang deployments' pages interchangeable."""

    model: str
    weights: str  # ``weights_fingerprint`` of the model path ("" where it is not a directory)
    kv_dtype: str
    layout: str
    page_size: int
    blob_bytes: tuple[int, ...]  # one page's blobs, as the host pool lays them out
    tp_size: int
    is_mla: bool
    dcp_size: int = 1
    salt: str = ""
    engine: str = "sglang"
    key_format: int = KEY_FORMAT_VERSION

    @property
    def description(self) -> str:
        """The canonical text the digest is the SHA-256 of: what the backend tells the
        coordinator (DESCRIBE) so its event stream publishes this namespace's pages with
        SGLang's hashes (``tiercache.link.namespaces``; its prefix there is the digest's
        first 8 bytes)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.description.encode()).digest()[:NAMESPACE_BYTES]

    def describe(self) -> str:
        parallel = "MLA (one replicated page)" if self.is_mla else f"TP{self.tp_size}"
        return (f"sglang {self.model} {self.kv_dtype} {self.layout}, page {self.page_size} "
                f"tokens, {parallel}, blobs {list(self.blob_bytes)}"
                + (f", salt {self.salt!r}" if self.salt else "") + f" -> {self.digest.hex()}")


def page_key(digest: bytes, shard: int, page_hash: str) -> bytes:
    """The tiercache key of SGLang page ``page_hash`` for ``shard`` (module docstring)."""
    if not isinstance(page_hash, str):
        raise ArgumentError(f"an SGLang page key must be a str; got {type(page_hash).__name__}")
    if _HEX64.fullmatch(page_hash):
        tail = _HASH_HEX + bytes.fromhex(page_hash)
    else:
        text = page_hash.encode()
        if len(text) > MAX_HASH_BYTES:
            raise ArgumentError(f"an SGLang page key of {len(text)} bytes: at most "
                                f"{MAX_HASH_BYTES}")
        tail = _HASH_TEXT + text
    return digest + shard.to_bytes(2, "little") + tail


def weights_fingerprint(model: str | None) -> str:
    """A digest of the weights at ``model`` where it is a local directory (else "")."""
    path = _model_dir(model)
    if path is None:
        return ""
    h = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for entry in sorted(path.iterdir()):
        if not entry.name.endswith(_WEIGHT_SUFFIXES):
            continue
        try:
            stat = entry.stat()
        except OSError:
            continue
        target = os.path.basename(os.path.realpath(entry))
        identity = target if _HEX64.fullmatch(target) else str(stat.st_mtime_ns)
        h.update(f"{entry.name}\0{stat.st_size}\0{identity}\n".encode())
    return h.hexdigest()[:32]


def _model_dir(model: str | None) -> Path | None:
    """The directory ``model`` names: SGLang may append the host pool's format tag
    (``path-tag``, the tag may hold dashes), so shorter prefixes cut at dashes are tried
    too, longest first."""
    if not model:
        return None
    candidate = model
    while True:
        if os.path.isdir(candidate):
            return Path(candidate)
        if "-" not in candidate:
            return None
        candidate = candidate.rsplit("-", 1)[0]
