"""The gated delta rule's backward on Hopper with Triton 3.4 to 3.7.0: fla's kernel at a tiling that
Triton compiles correctly there, through fla's own backend registry.

Triton from 3.4 up to 3.7.1 miscompiles, on Hopper, the transpose of a matmul result feeding a second
matmul in fla's ``chunk_bwd_kernel_dqkwg`` when its key tile ``BK`` is 64 (fla-org/flash-linear-
attention #640: wrong ``dk`` and, through it, ``dg``). fla's Hopper launcher picks ``BK = min(
next_pow2(K), 128)``, so ``K <= 64`` heads hit the bad tile, and fla-core refuses every gated call on
those Triton versions unless TileLang is installed. The kernel masks its key tile against ``K``, so
it computes the same gradients at ``BK = 128`` for any ``K`` (a wider tile, never a narrower one),
which is the tiling at which fla's own tests pass on Hopper (``K = 100 -> BK = 128``).

:func:`register_hopper_backend` registers that launcher as a backend of fla's ``"common"`` operations,
taken only where fla would refuse (Hopper, Triton in ``[3.4, 3.7.1)``, gated call) and after fla's
TileLang backend when that is installed. The GPU tests check every gradient of the gated delta rule
against the float32 plain-torch reference, ``K = 64`` and ``K = 128``.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["register_hopper_backend"]

_REGISTERED: list[bool] = []


def _affected() -> bool:
    utils = importlib.import_module("fla.utils")
    return bool(
        getattr(utils, "IS_NVIDIA_HOPPER", False)
        and getattr(utils, "TRITON_ABOVE_3_4_0", False)
        and not getattr(utils, "TRITON_ABOVE_3_7_1", True)
    )


def _wide_tile_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """fla's ``chunk_bwd_dqkwg`` with the key and value tiles at 128 (same outputs, same layout)."""
    import triton

    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    prepare_chunk_indices = importlib.import_module("fla.ops.utils").prepare_chunk_indices
    batch, length, heads, width_k, width_v, heads_v = *k.shape, v.shape[-1], v.shape[2]
    block_t = chunk_size
    if chunk_indices is None and cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, block_t)
    chunks = triton.cdiv(length, block_t) if cu_seqlens is None else len(chunk_indices)
    block_k = block_v = 128
    key_blocks = triton.cdiv(width_k, block_k)
    dq = q.new_empty(batch, length, heads_v, width_k)
    dk = k.new_empty(batch, length, heads_v, width_k)
    dg = torch.empty(key_blocks, *g.shape, dtype=torch.float32, device=g.device) if g is not None else None
    dw = torch.empty_like(w) if w is not None else None
    chunk_o.chunk_bwd_kernel_dqkwg[(key_blocks * chunks, batch * heads_v)](
        q=q, k=k, v=v, g=g, g_gamma=g_gamma, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, B=batch, T=length, H=heads,
        HV=heads_v, K=width_k, V=width_v, BT=block_t, BK=block_k, BV=block_v, STATE_V_FIRST=state_v_first,
    )  # fmt: skip
    if heads != heads_v:
        dq = dq.view(batch, length, heads, heads_v // heads, width_k).sum(3)
        dk = dk.view(batch, length, heads, heads_v // heads, width_k).sum(3)
    if dg is not None:
        dg = dg.sum(0)
    return dq, dk, dw, dg


def register_hopper_backend() -> bool:
    """Register the wide-tile launcher with fla where fla would refuse the gated backward.

    Returns:
        Whether the backend is registered (once per process; ``False`` off Hopper or on a Triton
        that compiles fla's own tiling correctly).
    """
    if _REGISTERED:
        return _REGISTERED[0]
    backends = importlib.import_module("fla.backends")
    importlib.import_module("fla.ops.common.chunk_o")  # loads fla's own backends of "common" first
    affected = _affected()
    if affected:

        class SlothWideTileBackend(backends.BaseBackend):
            backend_type = "sloth_wide_tile"
            priority = 6  # after fla's TileLang backend (5) when that is installed

            def chunk_bwd_dqkwg_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
                names = ("q", "k", "v", "do", "h", "dh", "w", "g", "g_gamma")
                bound = dict(zip(names, args)) | kwargs
                if bound.get("g") is None:
                    return False, "ungated: fla's own tiling is correct"
                return True, None

            def chunk_bwd_dqkwg(self, *args, **kwargs):
                return _wide_tile_dqkwg(*args, **kwargs)

        backends.register("common")(SlothWideTileBackend)
    _REGISTERED.append(affected)
    return affected
