"""The replay's cost model: how long an engine step and a KV transfer last on the clock.

Calibrated on one H100 (``nvidia-h100-x1``, 2026-12-07): ``benchmarks/model_cost_gpu.py``
timed a decoder of Llama-3.1-8B's shape (random bf16 weights, eager PyTorch) at 6 prefill
and 8 decode points, ``docs/results/model_cost_h100_llama8b.json``; ``benchmarks/
fit_model_cost.py`` fits the four constants below to those points, and
``tests/tools/test_replay_cost.py`` holds the model to every point. For one engine step,
each scheduled request computing ``new`` tokens after ``past`` tokens of context:

    compute_s = flops / (H100_PEAK_FLOPS * MFU)
        flops = 2 * matmul_params * sum(new)                 (every layer's projections)
              + 4 * heads * head_dim * layers * sum(new * (past + new / 2))   (attention)
    memory_s  = (weight bytes + kv_bytes_per_token * sum(past + new)) / (HBM_BPS * HBM_EFFICIENCY)
              + STEP_OVERHEAD_S
    step_s    = (compute_s ** ROOFLINE_P + memory_s ** ROOFLINE_P) ** (1 / ROOFLINE_P)

A smooth roofline: the larger bound far from the ridge (a long prefill is compute, a decode
step memory), and above both near it, where a 256-token prefill is bound by neither (9.05 ms
measured against 6.2 ms of compute and 4.7 ms of weights). ``STEP_OVERHEAD_S`` is what a
memory-bound step costs beyond its bytes: the harness's eager kernel launches, which a
long compute-bound step hides; vLLM's CUDA graphs would shorten small steps by up to that.

A step that computes nothing (a request waits for its load or for tiercache's probe)
lasts ``IDLE_STEP_S``. A transfer job lasts ``bytes / bps`` on its engine's PCIe line, one
line per direction, jobs in submission order (``engine.TransferLine``). A load's blocks
that tiercache promoted from its disk tier are first read at ``disk_read_bps`` on the
node's one disk line (``disk_read_s``; the engine's load job enters its PCIe line once
they are read). Bytes are the model's true KV bytes, whatever the tiercache arm moves for
real.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tiercache.config.hf_model import HFModel
from tiercache.errors import ConfigError

# NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB.
H100_PEAK_FLOPS = 989.4e12
H100_HBM_BPS = 3.35e12
H100_HBM_BYTES = 80e9
# Fit by benchmarks/fit_model_cost.py to docs/results/model_cost_h100_llama8b.json (H100
# 80GB HBM3, torch 2.11+cu130, 2026-12-07): the least worst-case relative error over every
# point but decode batch 1 / context 1,024, which the same run contradicts (see the script),
# plus the RMS error as a tie-break; worst error 4.0 % (prefill 512 and 4,096 tokens).
MFU = 0.60  # of H100_PEAK_FLOPS (prefill of 512..8,192 tokens ran at 0.57-0.59 of it)
HBM_EFFICIENCY = 0.91  # of H100_HBM_BPS (the KV read alone, decode's slope: 0.95 of it)
STEP_OVERHEAD_S = 2.30e-3  # a memory-bound step beyond its bytes (eager launches)
ROOFLINE_P = 2.5  # the p-norm that joins the two bounds near the ridge
CALIBRATION = "docs/results/model_cost_h100_llama8b.json"
# docs/benchmarks.md, "End to end on 2 GPUs": tiercache's `auto` backend, one H100 rank,
# 49.06 GB/s host-to-device and 49.97 GB/s device-to-host (0.89-0.90 of the PCIe ceiling;
# the calibration run's own ceiling: 55.5 / 55.3 GB/s).
TIERCACHE_LOAD_BPS = 49.06e9
TIERCACHE_STORE_BPS = 49.97e9
# vLLM 0.33's CPU offloading copy, replicated on one H100 (its compiled ops cannot run on
# the device machine): one cuMemcpyBatchAsync per transfer over every 32 KiB descriptor of
# its per-layer K/V tensors (64 a Llama-3.1-8B block), STREAM stores / ANY loads, engine
# view of 256-block transfers: 29.3 GB/s loads, 30.4 GB/s stores (0.53 / 0.55 of that run's
# 55.4 / 55.3 GB/s ceiling; tiercache's auto beside it 0.94 / 0.93): benchmarks/
# vllm_native_copy_gpu.py, docs/results/vllm_native_copy_h100.json. The engines start only
# once the driver has walked all 16,384 descriptors.
VLLM_NATIVE_LOAD_BPS = 29.3e9
VLLM_NATIVE_STORE_BPS = 30.4e9
# docs/benchmarks.md, "Disk tier (issue 18)": the disk tier's promotion (disk to host, O_DIRECT
# preadv, CRC checked) on the H100 host (`nvidia-h100-x1`, 2026-11-24, final tree, 4 I/O
# threads): 1.49 GB/s, docs/results/disk_tier_h100_host_final_t4.txt. Its eight runs there
# (4 and 8 threads) gave 1.09-1.83 GB/s; this one is near their median (1.53). The disk is
# a virtio block device, not a local NVMe: a node with NVMe reads faster.
TIERCACHE_DISK_READ_BPS = 1.49e9
IDLE_STEP_S = 1e-3  # an engine step with no forward pass (chosen, not measured)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
ACTIVATION_RESERVE_BYTES = 4e9  # activations, CUDA graphs, workspace (assumed)
BYTES_PER_PARAM = 2  # bf16 weights

PROVENANCE = {
    "peak_flops": "NVIDIA H100 SXM5 datasheet, dense BF16",
    "hbm_bps": "NVIDIA H100 SXM5 datasheet, HBM3",
    "mfu, hbm_efficiency, step_overhead_s, roofline_p":
        f"fit to a forward pass measured on one H100 80GB HBM3 (Llama-3.1-8B shape, random "
        f"bf16 weights, eager PyTorch 2.11, 2026-12-07): {CALIBRATION}, "
        "benchmarks/fit_model_cost.py; docs/benchmarks.md, 'The cost model against a "
        "forward pass on the GPU'",
    "shape": "counted from config.json (dense decoder: attention, MLP, LM head)",
    "load_store_bps": "tiercache: measured, docs/benchmarks.md 'End to end on 2 GPUs' "
                      "(auto backend, one H100 rank); vllm_native: its copy (one "
                      "cuMemcpyBatchAsync of per-layer 32 KiB descriptors) replicated on one "
                      "H100, docs/results/vllm_native_copy_h100.json",
    "disk_read_bps": "tiercache's disk tier only: its promotion rate measured on the H100 host "
                     "(virtio disk, 4 I/O threads), docs/benchmarks.md 'Disk tier (issue 18)', "
                     "docs/results/disk_tier_h100_host_final_t4.txt",
    "idle_step_s": "chosen, not measured",
    "measured_on_gpu": True,
}


@dataclass(frozen=True)
class DecoderShape:
    """The counts the model needs from a dense decoder's config (MoE and MLA: rough)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def of(cls, hf: HFModel) -> DecoderShape:
        f = hf.fields
        hidden, heads = int(f["hidden_size"]), int(f["num_attention_heads"])
        return cls(layers=int(f["num_hidden_layers"]), hidden=hidden, heads=heads,
                   kv_heads=int(f.get("num_key_value_heads", heads)),
                   head_dim=int(f.get("head_dim") or hidden // heads),
                   intermediate=int(f.get("intermediate_size", 4 * hidden)),
                   vocab=int(f.get("vocab_size", 32000)),
                   tied_embeddings=bool(f.get("tie_word_embeddings")))

    @property
    def matmul_params(self) -> int:
        """Every layer's projections: q, k, v, o, and the gated MLP's three."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """What the weights hold: the layers, the LM head and (untied) the embeddings."""
        return self.matmul_params + self.head_params * (1 if self.tied_embeddings else 2)

    @property
    def attention_pair_flops(self) -> int:
        """One query token against one key token, every layer: QK^T and PV."""
        return 4 * self.heads * self.head_dim * self.layers


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: ``new_tokens`` computed after ``past_tokens``."""

    new_tokens: int
    past_tokens: int


@dataclass(frozen=True)
class CostModel:
    """See the module docstring; every rate in SI units, every time in seconds."""

    params: int
    matmul_params: int
    head_params: int
    attention_pair_flops: int
    kv_bytes_per_token: int
    block_tokens: int
    load_bps: float
    store_bps: float
    peak_flops: float = H100_PEAK_FLOPS
    hbm_bps: float = H100_HBM_BPS
    mfu: float = MFU
    hbm_efficiency: float = HBM_EFFICIENCY
    step_overhead_s: float = STEP_OVERHEAD_S
    roofline_p: float = ROOFLINE_P
    idle_step_s: float = IDLE_STEP_S
    disk_read_bps: float = TIERCACHE_DISK_READ_BPS  # tiercache's disk tier, node-wide

    def __post_init__(self) -> None:
        for name in ("params", "matmul_params", "head_params", "attention_pair_flops",
                     "kv_bytes_per_token", "block_tokens", "load_bps", "store_bps", "mfu",
                     "hbm_efficiency", "roofline_p", "disk_read_bps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"cost model {name} = {getattr(self, name)}: must be > 0")

    @classmethod
    def for_shape(cls, shape: DecoderShape, kv_bytes_per_token: int, block_tokens: int,
                  load_bps: float, store_bps: float,
                  disk_read_bps: float = TIERCACHE_DISK_READ_BPS) -> CostModel:
        return cls(params=shape.params, matmul_params=shape.matmul_params,
                   head_params=shape.head_params,
                   attention_pair_flops=shape.attention_pair_flops,
                   kv_bytes_per_token=kv_bytes_per_token, block_tokens=block_tokens,
                   load_bps=load_bps, store_bps=store_bps, disk_read_bps=disk_read_bps)

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def weights_read_bytes(self) -> int:
        """What every forward pass reads: the layers and the LM head (not the embeddings,
        of which it gathers a row a token)."""
        return (self.matmul_params + self.head_params) * BYTES_PER_PARAM

    def flops(self, chunks: Sequence[Chunk]) -> float:
        pairs = sum(c.new_tokens * (c.past_tokens + c.new_tokens / 2) for c in chunks)
        return (2 * self.matmul_params * sum(c.new_tokens for c in chunks)
                + self.attention_pair_flops * pairs)

    def hbm_bytes(self, chunks: Sequence[Chunk]) -> float:
        kv_tokens = sum(c.past_tokens + c.new_tokens for c in chunks)
        return self.weights_read_bytes + kv_tokens * self.kv_bytes_per_token

    def step_s(self, chunks: Sequence[Chunk]) -> float:
        if not any(c.new_tokens for c in chunks):
            return self.idle_step_s
        compute_s = self.flops(chunks) / (self.peak_flops * self.mfu)
        memory_s = (self.hbm_bytes(chunks) / (self.hbm_bps * self.hbm_efficiency)
                    + self.step_overhead_s)
        p = self.roofline_p
        return float((compute_s ** p + memory_s ** p) ** (1 / p))

    def load_s(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.load_bps

    def store_s(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.store_bps

    def disk_read_s(self, num_blocks: int) -> float:
        """Reading ``num_blocks`` of the model's true size from tiercache's disk tier."""
        return num_blocks * self.block_bytes / self.disk_read_bps

    def describe(self) -> dict[str, Any]:
        """The report's ``cost_model``: every parameter, derived rates and provenance."""
        return {**asdict(self), "weights_read_bytes": self.weights_read_bytes,
                "block_bytes": self.block_bytes, "calibration": CALIBRATION,
                "provenance": PROVENANCE}


def hbm_kv_tokens(params: int, kv_bytes_per_token: int) -> int:
    """The KV tokens vLLM fits on one H100 serving the model at its default utilisation."""
    room = (H100_HBM_BYTES * GPU_MEMORY_UTILIZATION - params * BYTES_PER_PARAM
            - ACTIVATION_RESERVE_BYTES)
    if room <= 0:
        raise ConfigError(f"a model of {params / 1e9:.1f} B parameters leaves no KV room on "
                          "one 80 GB H100: give --gpu-kv-tokens")
    return int(room // kv_bytes_per_token)
