"""The replay's cost model: how long an engine step and a KV transfer last on the clock.

Not measured yet. The issue asks for prefill and decode times from a real forward pass on
the GPU machine and for each system's measured bandwidths; until then every figure is a
named constant derived from a datasheet or an earlier measurement, and the report's
``cost_model`` says which (``provenance``). The model, for one step of an engine:

    step_s = weights_read_s                      (each forward pass reads every weight once)
           + computed_tokens * flops_per_token / (PEAK_FLOPS * MFU)   (prefill and decode)
           + decode context tokens * kv_bytes_per_token / (HBM_BPS * HBM_EFFICIENCY)
           + sync loads (bytes / load_bps; vLLM's default loads asynchronously)

A step that computes nothing (a request waits for its load or for tiercache's probe)
lasts ``IDLE_STEP_S``. A transfer job lasts ``bytes / bps`` on its engine's PCIe line, one
line per direction, jobs in submission order (``transfers.TransferLine``). Bytes are the
model's true KV bytes, whatever the tiercache arm moves for real.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tiercache.config.hf_model import HFModel
from tiercache.errors import ConfigError

# NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB.
H100_PEAK_FLOPS = 989.4e12
H100_HBM_BPS = 3.35e12
H100_HBM_BYTES = 80e9
MFU = 0.5  # assumed model FLOPs utilisation of a prefill-heavy batch (not measured)
HBM_EFFICIENCY = 0.8  # assumed fraction of HBM bandwidth a decode step reaches (not measured)
# docs/benchmarks.md, "End to end on 2 GPUs": tiercache's `auto` backend, one H100 rank,
# 49.06 GB/s host-to-device and 49.97 GB/s device-to-host (0.89-0.90 of the PCIe ceiling).
TIERCACHE_LOAD_BPS = 49.06e9
TIERCACHE_STORE_BPS = 49.97e9
# vLLM's CPU offloading worker was not measured here: assumed equal to tiercache's, so that
# the systems differ by what they hit, not by their copies.
VLLM_NATIVE_LOAD_BPS = TIERCACHE_LOAD_BPS
VLLM_NATIVE_STORE_BPS = TIERCACHE_STORE_BPS
IDLE_STEP_S = 1e-3  # an engine step with no forward pass (chosen, not measured)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
ACTIVATION_RESERVE_BYTES = 4e9  # activations, CUDA graphs, workspace (assumed)
BYTES_PER_PARAM = 2  # bf16 weights

PROVENANCE = {
    "peak_flops": "NVIDIA H100 SXM5 datasheet, dense BF16",
    "hbm_bps": "NVIDIA H100 SXM5 datasheet, HBM3",
    "mfu": "assumed 0.5, not measured",
    "hbm_efficiency": "assumed 0.8, not measured",
    "params": "counted from config.json (dense decoder: embeddings, attention, MLP)",
    "load_store_bps": "tiercache: measured, docs/benchmarks.md 'End to end on 2 GPUs' "
                      "(auto backend, one H100 rank); vllm_native: assumed equal, not measured",
    "idle_step_s": "chosen, not measured",
    "measured_on_gpu": False,
}


def dense_params(hf: HFModel) -> int:
    """Parameters of a dense decoder from its config (MoE and MLA: a rough count)."""
    f = hf.fields
    hidden = int(f["hidden_size"])
    heads = int(f["num_attention_heads"])
    head_dim = int(f.get("head_dim") or hidden // heads)
    kv_heads = int(f.get("num_key_value_heads", heads))
    inter = int(f.get("intermediate_size", 4 * hidden))
    vocab = int(f.get("vocab_size", 32000))
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attention + 3 * hidden * inter
    embeddings = vocab * hidden * (1 if f.get("tie_word_embeddings") else 2)
    return int(f["num_hidden_layers"]) * per_layer + embeddings


@dataclass(frozen=True)
class CostModel:
    """See the module docstring; every rate in SI units, every time in seconds."""

    params: int
    kv_bytes_per_token: int
    block_tokens: int
    load_bps: float
    store_bps: float
    peak_flops: float = H100_PEAK_FLOPS
    hbm_bps: float = H100_HBM_BPS
    mfu: float = MFU
    hbm_efficiency: float = HBM_EFFICIENCY
    idle_step_s: float = IDLE_STEP_S

    def __post_init__(self) -> None:
        for name in ("params", "kv_bytes_per_token", "block_tokens", "load_bps", "store_bps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"cost model {name} = {getattr(self, name)}: must be > 0")

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def token_s(self) -> float:
        """One computed token (prefill or decode): 2 FLOPs per parameter."""
        return 2 * self.params / (self.peak_flops * self.mfu)

    @property
    def weights_read_s(self) -> float:
        return self.params * BYTES_PER_PARAM / (self.hbm_bps * self.hbm_efficiency)

    def step_s(self, computed_tokens: int, decode_context_tokens: int) -> float:
        if computed_tokens == 0:
            return self.idle_step_s
        kv_read = decode_context_tokens * self.kv_bytes_per_token
        return (self.weights_read_s + computed_tokens * self.token_s
                + kv_read / (self.hbm_bps * self.hbm_efficiency))

    def load_s(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.load_bps

    def store_s(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.store_bps

    def describe(self) -> dict[str, Any]:
        """The report's ``cost_model``: every parameter, derived rates and provenance."""
        return {**asdict(self), "token_s": self.token_s, "weights_read_s": self.weights_read_s,
                "block_bytes": self.block_bytes, "provenance": PROVENANCE}


def hbm_kv_tokens(params: int, kv_bytes_per_token: int) -> int:
    """The KV tokens vLLM fits on one H100 serving the model at its default utilisation."""
    room = (H100_HBM_BYTES * GPU_MEMORY_UTILIZATION - params * BYTES_PER_PARAM
            - ACTIVATION_RESERVE_BYTES)
    if room <= 0:
        raise ConfigError(f"a model of {params / 1e9:.1f} B parameters leaves no KV room on "
                          "one 80 GB H100: give --gpu-kv-tokens")
    return int(room // kv_bytes_per_token)
