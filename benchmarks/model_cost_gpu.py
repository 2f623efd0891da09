"""Measured inputs of `tiercache replay`'s cost model, on a GPU (issue 40).

A decoder of a model's exact shape (its config.json: layers, hidden size, heads, KV heads,
head size, MLP size, vocabulary) with random bf16 weights, in plain PyTorch (matmuls, RMSNorm,
rotary-free attention through ``scaled_dot_product_attention``: the FLOPs and bytes of the
model, not its numerics). Timed with CUDA events after warm-up, median of repeats:

* prefill: one request of n tokens, n = 256 .. 8192: seconds, and seconds per token;
* decode: one step of a batch of b requests with c tokens of context each (KV in HBM);
* the copy ceiling of the same run: one large pinned host->device and device->host copy.

    python benchmarks/model_cost_gpu.py tests/fixtures/models/Llama-3.1-8B-Instruct --json OUT

The numbers feed the cost model's defaults (tiercache/tools/replay); docs/benchmarks.md
records each run with its machine and date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def shape(config_path: Path) -> dict:
    cfg = json.loads(config_path.read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"], "heads": heads,
            "kv_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "mlp": cfg["intermediate_size"], "vocab": cfg["vocab_size"]}


class Decoder:
    """Random bf16 weights of the shape; ``forward(x, kv)`` runs every layer."""

    def __init__(self, s: dict, device: torch.device):
        self.s = s
        h, d, q, k = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"]
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims):
            return (torch.randn(*dims, generator=g, device=device, dtype=torch.bfloat16)
                    * dims[-1] ** -0.5)

        self.layers = [dict(qkv=w((q + 2 * k) * d, h), o=w(h, q * d), up=w(2 * s["mlp"], h),
                            down=w(h, s["mlp"]), n1=torch.ones(h, device=device,
                                                               dtype=torch.bfloat16),
                            n2=torch.ones(h, device=device, dtype=torch.bfloat16))
                       for _ in range(s["layers"])]
        self.head = w(s["vocab"], h)

    def forward(self, x: torch.Tensor, past: int = 0, kv: list | None = None) -> torch.Tensor:
        """x: (batch, tokens, hidden). ``kv`` (per layer K and V, room for ``past`` tokens
        and these) makes it a decode step attending to them: the new tokens' K and V are
        written after the past in place, as a paged cache does, and the attention reads
        ``past + tokens`` of them."""
        s = self.s
        b, n, _ = x.shape
        q_h, k_h, d = s["heads"], s["kv_heads"], s["head_dim"]
        for i, layer in enumerate(self.layers):
            y = F.rms_norm(x, (s["hidden"],), layer["n1"])
            qkv = y @ layer["qkv"].T
            q, k, v = qkv.split([q_h * d, k_h * d, k_h * d], dim=-1)
            q = q.view(b, n, q_h, d).transpose(1, 2)
            k = k.view(b, n, k_h, d).transpose(1, 2)
            v = v.view(b, n, k_h, d).transpose(1, 2)
            if kv is not None:  # written in place after the past, read once (no copy)
                kv[i][0][:, :, past:past + n] = k
                kv[i][1][:, :, past:past + n] = v
                k, v = kv[i][0][:, :, :past + n], kv[i][1][:, :, :past + n]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=kv is None, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, n, q_h * d) @ layer["o"].T
            y = F.rms_norm(x, (s["hidden"],), layer["n2"])
            up, gate = (y @ layer["up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        return x[:, -1] @ self.head.T


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_ceiling(device: torch.device, nbytes: int = 4 << 30) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    return {"bytes": nbytes, "h2d_gb_s": nbytes / h2d / 1e9, "d2h_gb_s": nbytes / d2h / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="model directory (its config.json)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    s = shape(args.model / "config.json")
    model = Decoder(s, device)
    out: dict = {"model": args.model.name, "shape": s, "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "prefill": [], "decode": []}
    with torch.inference_mode():
        for n in (256, 512, 1024, 2048, 4096, 8192):
            x = torch.randn(1, n, s["hidden"], device=device, dtype=torch.bfloat16)
            t = timed(lambda: model.forward(x))
            out["prefill"].append({"tokens": n, "s": t, "s_per_token": t / n})
            print(f"prefill {n:5d} tokens: {t * 1e3:8.2f} ms  {t / n * 1e6:7.2f} us/token",
                  flush=True)
        for batch in (1, 8, 32, 64):
            for context in (1024, 4096):
                kv = [tuple(torch.randn(batch, s["kv_heads"], context + 1, s["head_dim"],
                                        device=device, dtype=torch.bfloat16) for _ in "kv")
                      for _ in range(s["layers"])]
                x = torch.randn(batch, 1, s["hidden"], device=device, dtype=torch.bfloat16)
                t = timed(lambda: model.forward(x, context, kv))
                out["decode"].append({"batch": batch, "context": context, "s": t})
                print(f"decode batch {batch:3d} context {context:5d}: {t * 1e3:8.2f} ms",
                      flush=True)
                kv = None  # free this size's KV before the next
                torch.cuda.empty_cache()
    out["copy_ceiling"] = copy_ceiling(device)
    print(f"copy ceiling: H2D {out['copy_ceiling']['h2d_gb_s']:.1f} GB/s, "
          f"D2H {out['copy_ceiling']['d2h_gb_s']:.1f} GB/s", flush=True)
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
