"""The fused MoE grouped GEMM alone (rows read through the routing permutation) against variants of
its kernel and against ``torch._grouped_mm`` on the gathered rows, in TFLOP/s.

Variants, as ``(BM, BN, BK, warps, stages, GROUP_M, W through a TMA descriptor, X through one,
warp-specialised, persistent)``:
loads without a K mask where BK divides K, programs in groups of GROUP_M M tiles, the expert weight
(and, for rows already in expert order, the input) through host TMA descriptors. Four GEMMs per
shape: the first MoE GEMM reading token rows through the permutation and the second reading rows in
expert order, each with the weight ``[E, K, N]`` and ``[E, N, K]``, and the rank-16 LoRA side of the
first (``x A^T``, bandwidth-bound: GB/s of rows read). Every variant is checked against
``torch._grouped_mm`` (relative max error). JSON to ``--out`` (default ``$OUT`` or
``benchmarks/results/``), a line per variant.

    python benchmarks/moe_gemm_variants.py  # gpu
"""

import argparse
import functools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels import moe_fused
from lightning_sloth.kernels.moe import _tile_table
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _k(
    X, W, OUT, TILE_EXPERT, TILE_ROW, ENDS, A_IDX, XD, WD, n_out, n_in, div, max_tiles,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A_INDEXED: tl.constexpr, EVEN_K: tl.constexpr,
    GM: tl.constexpr, W_DESC: tl.constexpr, W_KN: tl.constexpr, X_DESC: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    tiles_n = tl.cdiv(n_out, BN)
    pid = tl.program_id(0)
    if GM > 1:
        in_group = GM * tiles_n
        first = (pid // in_group) * GM
        size = min(max_tiles - first, GM)
        tile = first + (pid % in_group) % size
        pid_n = (pid % in_group) // size
    else:
        tile = pid // tiles_n
        pid_n = pid % tiles_n
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= 0:
        row0 = tl.load(TILE_ROW + tile)
        end = tl.load(ENDS + expert).to(tl.int64)
        rows = row0.to(tl.int64) + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_mask = rows < end
        col_mask = cols < n_out
        if A_INDEXED:
            slots = tl.load(A_IDX + rows, mask=row_mask, other=0).to(tl.int64)
            a_rows = slots // div
        else:
            a_rows = rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, n_in, BK, warp_specialize=WS):
            ks = k0 + tl.arange(0, BK)
            if X_DESC:
                x = XD.load([row0, k0])
            elif EVEN_K:
                x = tl.load(
                    X + a_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None],
                    other=0.0,
                )
            else:
                x = tl.load(
                    X + a_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & (ks < n_in)[None, :],
                    other=0.0,
                )
            if W_DESC:
                if W_KN:
                    w = WD.load([expert, k0, pid_n * BN]).reshape(BK, BN)
                else:
                    w = tl.trans(WD.load([expert, pid_n * BN, k0]).reshape(BN, BK))
            elif EVEN_K:
                w = tl.load(
                    W + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=col_mask[None, :],
                    other=0.0,
                )
            else:
                w = tl.load(
                    W + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=(ks < n_in)[:, None] & col_mask[None, :],
                    other=0.0,
                )
            acc = tl.dot(x, w, acc)
        out_ptrs = OUT + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _kp(
    X, OUT, TILE_EXPERT, TILE_ROW, ENDS, A_IDX, N_VALID, XD, WD, n_out, n_in, div,
    stride_xm, stride_xk, stride_om, stride_on,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A_INDEXED: tl.constexpr, GM: tl.constexpr,
    W_KN: tl.constexpr, X_DESC: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    # Persistent: one program per SM walks the valid tiles (the tile table puts them first; their
    # count is read on the device, no host sync); W (and X in expert order) through TMA descriptors.
    tiles_n = tl.cdiv(n_out, BN)
    n_valid = tl.load(N_VALID)
    total = n_valid * tiles_n
    for pid in tl.range(tl.program_id(0), total, NUM_SMS, flatten=False, warp_specialize=WS):
        in_group = GM * tiles_n
        first = (pid // in_group) * GM
        size = min(n_valid - first, GM)
        tile = first + (pid % in_group) % size
        pid_n = (pid % in_group) // size
        expert = tl.load(TILE_EXPERT + tile)
        row0 = tl.load(TILE_ROW + tile)
        end = tl.load(ENDS + expert).to(tl.int64)
        rows = row0.to(tl.int64) + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_mask = rows < end
        if A_INDEXED:
            a_rows = tl.load(A_IDX + rows, mask=row_mask, other=0).to(tl.int64) // div
        else:
            a_rows = rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, n_in, BK):
            ks = k0 + tl.arange(0, BK)
            if X_DESC:
                x = XD.load([row0, k0])
            else:
                x = tl.load(
                    X + a_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & (ks < n_in)[None, :],
                    other=0.0,
                )
            if W_KN:
                w = WD.load([expert, k0, pid_n * BN]).reshape(BK, BN)
            else:
                w = tl.trans(WD.load([expert, pid_n * BN, k0]).reshape(BN, BK))
            acc = tl.dot(x, w, acc)
        out_ptrs = OUT + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & (cols < n_out)[None, :])


def persistent(x, w, ends, w_is_kn, a_idx, div, rows, cfg):
    bm, bn, bk, warps, stages, gm, _, xdesc, ws, _ = cfg
    n_in = x.shape[1]
    n_out = w.shape[2] if w_is_kn else w.shape[1]
    out = x.new_empty((rows, n_out))
    max_tiles = triton.cdiv(rows, bm) + w.shape[0]
    te, tr = _tile_table(ends, bm, max_tiles)
    n_valid = (te >= 0).sum().to(torch.int32).reshape(1)
    wd = TensorDescriptor.from_tensor(w, [1, bk, bn] if w_is_kn else [1, bn, bk])
    xd = TensorDescriptor.from_tensor(x, [bm, bk]) if xdesc else x
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    _kp[(sms,)](
        x, out, te, tr, ends, a_idx if a_idx is not None else ends, n_valid, xd, wd, n_out, n_in, div,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BM=bm, BN=bn, BK=bk, A_INDEXED=a_idx is not None, GM=gm, W_KN=w_is_kn, X_DESC=xdesc, NUM_SMS=sms,
        WS=ws, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def variant(x, w, ends, w_is_kn, a_idx, div, rows, cfg):
    """cfg: (BM, BN, BK, warps, stages, GROUP_M, W descriptor, X descriptor, warp-specialised, persistent)."""
    if cfg[9]:
        return persistent(x, w, ends, w_is_kn, a_idx, div, rows, cfg)
    bm, bn, bk, warps, stages, gm, wdesc, xdesc, ws, _ = cfg
    n_in = x.shape[1]
    n_out = w.shape[2] if w_is_kn else w.shape[1]
    experts = w.shape[0]
    out = x.new_empty((rows, n_out))
    max_tiles = triton.cdiv(rows, bm) + experts
    te, tr = _tile_table(ends, bm, max_tiles)
    swk, swn = (w.stride(1), w.stride(2)) if w_is_kn else (w.stride(2), w.stride(1))
    wd = TensorDescriptor.from_tensor(w, [1, bk, bn] if w_is_kn else [1, bn, bk]) if wdesc else w
    xd = TensorDescriptor.from_tensor(x, [bm, bk]) if xdesc else x
    grid = (max_tiles * triton.cdiv(n_out, bn),)
    _k[grid](
        x, w, out, te, tr, ends, a_idx if a_idx is not None else ends, xd, wd, n_out, n_in, div, max_tiles,
        x.stride(0), x.stride(1), w.stride(0), swk, swn, out.stride(0), out.stride(1),
        BM=bm, BN=bn, BK=bk, A_INDEXED=a_idx is not None, EVEN_K=n_in % bk == 0, GM=gm, W_DESC=wdesc,
        W_KN=w_is_kn, X_DESC=xdesc, WS=ws, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def timeit(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


CONFIGS = [
    # (BM, BN, BK, warps, stages, GROUP_M, W descriptor, X descriptor, warp-specialised, persistent)
    (128, 256, 64, 8, 4, 8, False, False, False, False),  # the kernel's loads and order since 6e5c10e
    (128, 256, 32, 8, 5, 8, False, False, False, False),
    (128, 256, 64, 8, 4, 8, True, False, False, False),
    (128, 256, 64, 8, 4, 8, True, True, False, False),
    (128, 256, 64, 8, 4, 8, True, False, True, False),
    (128, 256, 64, 8, 4, 8, True, True, True, False),
    (128, 256, 64, 8, 3, 8, True, False, False, True),
    (128, 256, 64, 8, 3, 8, True, True, False, True),
    (128, 256, 64, 8, 3, 8, True, False, True, True),
    (128, 256, 64, 8, 3, 8, True, True, True, True),
    (128, 128, 64, 8, 4, 8, True, True, True, True),
]

RANK_CONFIGS = [
    # the rank-r side alone (N = r = 16): memory-bound on the [S, K] rows it reads
    (128, 16, 64, 8, 4, 1, False, False, False, False),  # what the fused kernel's tiles give it
    (128, 16, 64, 4, 4, 1, False, False, False, False),
    (128, 16, 128, 4, 3, 1, False, False, False, False),
    (64, 16, 128, 4, 4, 1, False, False, False, False),
    (256, 16, 64, 8, 4, 1, False, False, False, False),
    (64, 16, 256, 4, 3, 1, False, False, False, False),
]

SHAPES = {
    # name: tokens, experts, top_k, hidden, inter (gate_up N = 2 inter)
    "gpt_oss_20b": (16384, 32, 4, 2880, 2880),
    "qwen3_30b_a3b": (16384, 128, 8, 2048, 768),
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--configs",
        default=";".join(",".join(str(int(v)) for v in c) for c in CONFIGS),
        help="BM,BN,BK,WARPS,STAGES,GROUP_M,W_DESC,X_DESC,WS,PERSISTENT (0/1 flags); several: ';'",
    )
    parser.add_argument(
        "--rank-configs",
        default=";".join(",".join(str(int(v)) for v in c) for c in RANK_CONFIGS),
        help="the same for the rank-16 case",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    out = {
        "device": torch.cuda.get_device_name(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "cases": {},
    }

    def alloc(size, align, stream):  # the scratch of device-side descriptors
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
    configs = [tuple(int(v) for v in part.split(",")) for part in args.configs.split(";")]
    rank_configs = [tuple(int(v) for v in part.split(",")) for part in args.rank_configs.split(";")]
    for name in args.shapes.split(","):
        tokens, experts, top_k, hidden, inter = SHAPES[name]
        logits = torch.randn(tokens, experts, device="cuda")
        topi = logits.topk(top_k, dim=1).indices.reshape(-1)
        order = torch.sort(topi, stable=True).indices  # perm[s] = slot
        counts = torch.bincount(topi, minlength=experts)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        rows = tokens * top_k
        offs = ends
        xt = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
        cases = {
            # (x, w [E,K,N] or [E,N,K], w_is_kn, a_idx, div, flops)
            "gate_up_fwd_indexed_kn": (
                xt,
                torch.randn(experts, hidden, 2 * inter, device="cuda", dtype=torch.bfloat16) * 0.02,
                True,
                order,
                top_k,
            ),
            "gate_up_fwd_indexed_nk": (
                xt,
                torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
                False,
                order,
                top_k,
            ),
            "down_fwd_contig_kn": (
                h,
                torch.randn(experts, inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
                True,
                None,
                1,
            ),
            "down_fwd_contig_nk": (
                h,
                torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02,
                False,
                None,
                1,
            ),
            "lora_down_indexed_r16": (  # x A^T of the first GEMM's LoRA, rows through the permutation
                xt,
                torch.randn(experts, 16, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
                False,
                order,
                top_k,
            ),
        }
        for case, (x, w, kn, a_idx, div) in cases.items():
            n_out = w.shape[2] if kn else w.shape[1]
            flops = 2 * rows * x.shape[1] * n_out
            xs = x[a_idx // div] if a_idx is not None else x
            wk = w if kn else w.transpose(1, 2)
            try:
                ref = torch._grouped_mm(xs, wk, offs=offs)
                res = {"grouped_mm_ms": timeit(functools.partial(torch._grouped_mm, xs, wk, offs=offs))}
                res["grouped_mm_tflops"] = flops / res["grouped_mm_ms"] / 1e9
            except RuntimeError as error:  # a layout torch._grouped_mm does not take: a per-expert reference
                starts = [0, *ends[:-1].tolist()]
                ref = torch.cat([xs[a:b] @ wk[e] for e, (a, b) in enumerate(zip(starts, ends.tolist()))])
                res = {
                    "grouped_mm_error": str(error).splitlines()[0][:200],
                    "grouped_mm_tflops": float("nan"),
                }
            moe_fused.TILES = None
            cur = functools.partial(
                moe_fused.grouped_mm, x, w, ends, kn, rows=rows, a_idx=a_idx, div=div, covered=True
            )
            res["current_ms"] = timeit(cur)
            res["current_tflops"] = flops / res["current_ms"] / 1e9
            res["current_err"] = ((cur().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            res["variants"] = []
            res["rows_read_gbps"] = rows * x.shape[1] * x.element_size() / res["current_ms"] / 1e6
            for cfg in rank_configs if n_out <= 64 else configs:
                if cfg[7] and a_idx is not None:
                    continue
                try:
                    fn = functools.partial(variant, x, w, ends, kn, a_idx, div, rows, cfg)
                    err = ((fn().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    ms = timeit(fn)
                    gbps = rows * x.shape[1] * x.element_size() / ms / 1e6
                    res["variants"].append(
                        {"cfg": cfg, "ms": ms, "tflops": flops / ms / 1e9, "rows_read_gbps": gbps, "err": err}
                    )
                except Exception as e:  # noqa: BLE001
                    res["variants"].append({"cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            out["cases"][f"{name}/{case}"] = res
            print(
                f"{name}/{case}: grouped_mm {res['grouped_mm_tflops']:.0f} TF/s, current {res['current_tflops']:.0f} (err {res['current_err']:.1e})",
                flush=True,
            )
            for v in res["variants"]:
                print(
                    "   ",
                    v["cfg"],
                    f"{v['tflops']:.0f} TF/s {v['rows_read_gbps']:.0f} GB/s err {v['err']:.1e}"
                    if "ms" in v
                    else v["error"][:150],
                    flush=True,
                )
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    path = args.out or str(folder / "moe_gemm_variants.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
