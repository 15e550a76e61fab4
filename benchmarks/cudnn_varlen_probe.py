"""Probe: today's flash varlen attention (FA2, K/V heads not repeated) against cuDNN's varlen
attention (``aten._cudnn_attention_forward`` with ``cum_seq_q/k``) on the benchmark's packed rows.

    python benchmarks/cudnn_varlen_probe.py  # writes $OUT/cudnn_varlen_probe.json

Three 16k-token rows of the Llama-3.2-1B workload's documents; Llama-1B heads (32/8, head_dim 64)
and Qwen3-0.6B heads (16/8, 128). cuDNN with GQA and with K/V repeated; its output and gradients
against FA2's (largest absolute difference, and the largest FA2 gradient for scale), and forward /
backward times (CUDA events, 3 warm-up + 20 timed).
"""

from __future__ import annotations

import json
import os

import torch

from lightning_sloth.attention import _VarlenFlash
from lightning_sloth.bench.workload import Workload
from lightning_sloth.data import pack_best_fit_decreasing

HEADS = [(32, 8, 64), (16, 8, 128)]


def fa2(q, k, v, cu, longest, scale):
    return _VarlenFlash.apply(q, k, v, cu, cu, longest, longest, scale, -1)


def cudnn(q, k, v, cu, longest, scale):
    out = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, longest, longest, True, 0.0, True, False, scale=scale
    )
    return out[0]


def timed(fn, inputs, cu, longest, scale, grad, steps: int = 20) -> tuple[float, float]:
    for _ in range(3):
        torch.autograd.grad(fn(*inputs, cu, longest, scale), inputs, grad)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    forward = backward = 0.0
    for _ in range(steps):
        events[0].record()
        out = fn(*inputs, cu, longest, scale)
        events[1].record()
        torch.autograd.grad(out, inputs, grad)
        events[2].record()
        torch.cuda.synchronize()
        forward += events[0].elapsed_time(events[1])
        backward += events[1].elapsed_time(events[2])
    return forward / steps, backward / steps


def probe(lengths: list[int], heads_q: int, heads_kv: int, head_dim: int) -> dict:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tokens, longest, scale = sum(lengths), max(lengths), head_dim**-0.5
    torch.manual_seed(0)

    def leaf(heads):
        return torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = leaf(heads_q), leaf(heads_kv), leaf(heads_kv)
    grad = torch.randn(tokens, heads_q, head_dim, device="cuda", dtype=torch.bfloat16)
    row = {"hq": heads_q, "hkv": heads_kv, "d": head_dim, "T": tokens, "docs": len(lengths), "max": longest}
    out = fa2(q, k, v, cu, longest, scale)
    want = torch.autograd.grad(out, (q, k, v), grad)
    row["fa2_ms"] = timed(fa2, (q, k, v), cu, longest, scale, grad)
    groups = heads_q // heads_kv
    for name in ("cudnn_gqa", "cudnn_rep"):
        try:
            kk, vv = k, v
            if name == "cudnn_rep":
                kk = k.detach().repeat_interleave(groups, 1).requires_grad_()
                vv = v.detach().repeat_interleave(groups, 1).requires_grad_()
            got_out = cudnn(q, kk, vv, cu, longest, scale)
            got = list(torch.autograd.grad(got_out, (q, kk, vv), grad))
            if got[1].shape != k.shape:  # repeated heads: sum each group's gradients back
                got[1:] = [g.view(tokens, heads_kv, groups, head_dim).sum(2) for g in got[1:]]
            row[name + "_maxdiff_out"] = float((got_out - out).abs().max())
            row[name + "_maxdiff_grad"] = [
                float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)
            ]
            row[name + "_ref_scale"] = [float(b.float().abs().max()) for b in want]
            row[name + "_ms"] = timed(cudnn, (q, kk, vv), cu, longest, scale, grad)
        except RuntimeError as exc:
            row[name + "_error"] = repr(exc)[:400]
    return row


def main() -> None:
    workload = Workload()
    lengths = workload.lengths(400)
    rows = pack_best_fit_decreasing(lengths, workload.tokens_per_step)[:3]
    result = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(),
        "rows": [],
    }
    for heads in HEADS:
        for idx in rows:
            row = probe([lengths[i] for i in idx], *heads)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "cudnn_varlen_probe.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
