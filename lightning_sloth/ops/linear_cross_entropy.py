"""Fused lm-head projection and cross-entropy that never materialises the ``[N, V]`` logits.

The tokens are processed in chunks of ``chunk_size`` rows::

    for each chunk c of hidden:                        hidden [N, H], weight [V, H]
        logits_c = hidden_c @ weight.T (+ bias)       [c, V]   cuBLAS, in the input dtype
        loss_c, logits_c := d loss_c / d logits_c      one Triton program per row, fp32 math
        grad_hidden_c = logits_c @ weight             [c, H]
        grad_weight  += logits_c.T @ hidden_c         [V, H]   fp32 accumulator

Because the loss is the op's only output, its gradients are computed eagerly in the forward pass,
while each chunk's logits are still at hand, and the backward only multiplies them by the incoming
gradient. When no gradient is wanted (eval, ``torch.no_grad``, frozen inputs) the forward skips the
gradient work. Peak memory is one chunk of logits (at most :data:`LOGITS_CHUNK_ELEMENTS`, or the
rows a ``chunk_bytes`` budget allows) plus the gradients, whatever N is. Nothing holds the
vocabulary in float32 but the weight's own gradient accumulator, and only when the lm head trains;
hidden's gradient is written chunk by chunk into one ``[N, H]`` buffer (outside torch.compile: a
concatenation would hold the chunks and the result at once, twice ``[N, H]`` at the end).

The saved gradients are those of the *summed* loss; the ``1 / count`` of the mean is applied in the
backward, in fp32, together with the incoming gradient. In float16, ``p / count`` per logit would
underflow in the forward before a loss scaler's factor could lift it.

The mean is taken over the non-ignored targets of the whole batch (not per chunk). The count stays a
device tensor, so nothing synchronises the host. ``num_items_in_batch`` replaces the count, as
transformers' ``ForCausalLMLoss`` does for gradient accumulation.
"""

import torch
from torch import Tensor

from lightning_sloth.ops.registry import TRITON_OPS, register_flops, sloth_op, use_triton

if TRITON_OPS:
    from lightning_sloth.kernels.cross_entropy import cross_entropy_rows_

__all__ = [
    "IGNORE_INDEX",
    "LOGITS_CHUNK_ELEMENTS",
    "chunk_size_for_bytes",
    "default_chunk_size",
    "linear_cross_entropy",
    "shift_labels",
]

IGNORE_INDEX = -100

LOGITS_CHUNK_ELEMENTS = 2**27
"""Most logits one chunk may hold (256 MiB in bf16): at V=128256 that is 1024 rows per chunk."""


def default_chunk_size(vocab_size: int, max_elements: int = LOGITS_CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that ``rows * vocab_size <= max_elements``.

    A multiple of 64 when at least 64 rows fit (matmul-friendly); at least 1. It does not depend on the
    number of tokens, so ``torch.compile`` sees the same value for every batch.
    """
    rows = max(1, max_elements // max(1, vocab_size))
    return rows - rows % 64 if rows >= 64 else rows


def chunk_size_for_bytes(vocab_size: int, chunk_bytes: int, dtype: torch.dtype) -> int:
    """Rows per chunk so that one chunk of logits in ``dtype`` takes at most ``chunk_bytes`` (the
    Triton row kernel works in place; the CPU reference adds float32 copies of the chunk)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes}")
    return default_chunk_size(vocab_size, chunk_bytes // torch.empty((), dtype=dtype).element_size())


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Shift transformers-convention labels into per-position targets.

    transformers' causal LMs take ``labels`` aligned with ``input_ids`` and shift them inside the loss:
    position ``t`` predicts ``labels[t + 1]``. :func:`linear_cross_entropy` takes targets that are
    already shifted; this builds them. A :class:`~lightning_sloth.data.batch.PackedBatch` sets every
    document's first label to ``ignore_index``, so no target crosses a document boundary.

    Args:
        labels: ``[..., T]`` integer labels.
        ignore_index: Value put at the last position, which has no next token.

    Returns:
        ``[..., T]`` targets, ``targets[..., t] = labels[..., t + 1]`` and ``targets[..., -1] = ignore_index``.
    """
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def _cross_entropy_rows_reference_(
    logits: Tensor, targets: Tensor, ignore_index: int, softcap: float | None, compute_grad: bool
) -> Tensor:
    """Plain-torch twin of ``kernels.cross_entropy.cross_entropy_rows_`` (same contract)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        capped = torch.tanh(z / softcap)
        z = softcap * capped
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0).unsqueeze(1)
    loss = torch.where(valid, lse - z.gather(1, safe_targets).squeeze(1), 0.0)
    if compute_grad:
        grad = torch.exp(z - lse.unsqueeze(1))
        grad.scatter_add_(1, safe_targets, torch.full_like(safe_targets, -1, dtype=grad.dtype))
        if softcap is not None:
            grad = grad * (1 - capped * capped)
        logits.copy_(torch.where(valid.unsqueeze(1), grad, 0.0))
    return loss


def _chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    num_items: Tensor | None,
    ignore_index: int,
    softcap: float | None,
    reduction: str,
    chunk_size: int,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    rows_fn,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop shared by the CUDA and CPU bodies; ``rows_fn`` is the per-chunk row kernel.

    Returns the loss, the gradients of the *summed* loss (hidden's in its dtype, weight's and bias's
    in the fp32 accumulator) and ``grad_scale``, which turns those into gradients of the returned loss.
    """
    n_rows = hidden.shape[0]
    device = hidden.device
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    compute_grad = grad_hidden or grad_weight or grad_bias
    loss = torch.zeros((), dtype=acc_dtype, device=device)
    # Under torch.compile chunks of d hidden are concatenated at the end (one copy instead of a
    # scatter per chunk); otherwise each is written into one buffer as it is made.
    concatenate = torch.compiler.is_compiling()
    d_hidden_chunks = []
    d_hidden_buffer = hidden.new_empty(hidden.shape) if grad_hidden and not concatenate else None
    d_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=device) if grad_weight else None
    d_bias = torch.zeros(weight.shape[0], dtype=acc_dtype, device=device) if grad_bias else None

    for start in range(0, n_rows, chunk_size):
        h_chunk = hidden[start : start + chunk_size]
        if bias is None:
            logits = h_chunk @ weight.t()
        else:
            logits = torch.addmm(bias, h_chunk, weight.t())
        rows = rows_fn(logits, targets[start : start + chunk_size], ignore_index, softcap, compute_grad)
        loss = loss + rows.sum(dtype=acc_dtype)
        # From here on ``logits`` holds d (sum of row losses) / d logits.
        if d_hidden_buffer is not None:
            torch.mm(logits, weight, out=d_hidden_buffer[start : start + chunk_size])
        elif grad_hidden:
            d_hidden_chunks.append(logits @ weight)
        if d_weight is not None:
            if d_weight.dtype == logits.dtype:
                d_weight.addmm_(logits.t(), h_chunk)
            else:
                d_weight.add_(logits.t() @ h_chunk)
        if d_bias is not None:
            d_bias.add_(logits.sum(0, dtype=acc_dtype))
        # Let this chunk's logits go before the next chunk's are made: two chunks would otherwise
        # be alive at once, while ``logits`` is rebound.
        del logits, rows

    if reduction == "sum":
        grad_scale = torch.ones((), dtype=acc_dtype, device=device)
    else:
        denominator = (num_items if num_items is not None else (targets != ignore_index).sum()).to(acc_dtype)
        loss = loss / denominator
        # A zero denominator (every target ignored) gives a nan loss, as F.cross_entropy, and zero
        # gradients, as F.cross_entropy's backward.
        grad_scale = torch.where(denominator != 0, torch.reciprocal(denominator), 0.0)

    if not grad_hidden:
        d_hidden = hidden.new_empty(0)
    elif d_hidden_buffer is not None:
        d_hidden = d_hidden_buffer
    elif len(d_hidden_chunks) == 1:
        d_hidden = d_hidden_chunks[0]
    elif d_hidden_chunks:
        d_hidden = torch.cat(d_hidden_chunks)
    else:
        d_hidden = hidden.new_empty(hidden.shape)
    if d_weight is None:
        d_weight = hidden.new_empty(0, dtype=acc_dtype)
    if d_bias is None:
        d_bias = hidden.new_empty(0, dtype=acc_dtype)
    return loss, d_hidden, d_weight, d_bias, grad_scale


@sloth_op("linear_cross_entropy")
def _linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    num_items: Tensor | None,
    ignore_index: int,
    softcap: float | None,
    reduction: str,
    chunk_size: int,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss, d_hidden, d_weight, d_bias, grad_scale)``.

    ``d_*`` are gradients of the summed (unnormalised) loss, empty where not requested; ``d_hidden``
    has hidden's dtype, ``d_weight``/``d_bias`` the fp32 accumulator's. The gradient of the returned
    loss is ``d_* * grad_scale`` (0-d, fp32). Normalising outside the forward keeps float16 gradients
    in range until the incoming gradient (e.g. a loss scale) multiplies them.
    """
    rows_fn = cross_entropy_rows_ if use_triton(hidden) else _cross_entropy_rows_reference_
    return _chunked_linear_cross_entropy(
        hidden,
        weight,
        bias,
        targets,
        num_items,
        ignore_index,
        softcap,
        reduction,
        chunk_size,
        grad_hidden,
        grad_weight,
        grad_bias,
        rows_fn,
    )


@_linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(
    hidden, weight, bias, targets, num_items, ignore_index, softcap, reduction, chunk_size, gh, gw, gb
):
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    loss = hidden.new_empty((), dtype=acc_dtype)
    d_hidden = hidden.new_empty(hidden.shape if gh else (0,))
    d_weight = weight.new_empty(weight.shape if gw else (0,), dtype=acc_dtype)
    d_bias = weight.new_empty(weight.shape[:1] if gb else (0,), dtype=acc_dtype)
    return loss, d_hidden, d_weight, d_bias, hidden.new_empty((), dtype=acc_dtype)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias = inputs[:3]
    _, d_hidden, d_weight, d_bias, grad_scale = output
    ctx.mark_non_differentiable(d_hidden, d_weight, d_bias, grad_scale)
    # No zero gradients made for those four outputs in the backward (one would be [N, H]).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(d_hidden, d_weight, d_bias, grad_scale)
    ctx.dtypes = tuple(t.dtype if t is not None else None for t in (hidden, weight, bias))
    ctx.computed = inputs[-3:]


def _backward(ctx, grad_loss, *_unused):
    if grad_loss is None:  # the loss was not used
        return (None,) * 12
    *saved, grad_scale = ctx.saved_tensors
    # The scale is applied in fp32: rounding it to bf16 first would bias the whole gradient.
    scale = grad_loss.to(grad_scale.dtype) * grad_scale
    grads = []
    for d_input, dtype, computed, needed, name in zip(
        saved, ctx.dtypes, ctx.computed, ctx.needs_input_grad[:3], ("hidden", "weight", "bias")
    ):
        if needed and not computed:
            raise RuntimeError(
                f"sloth::linear_cross_entropy was called with grad_{name}=False but {name} needs a "
                "gradient; call it through linear_cross_entropy(), which sets the flags"
            )
        grads.append(_scaled(d_input, scale, dtype) if needed else None)
    return (*grads, *([None] * 9))


_SCALE_ROWS = 8192
"""Rows scaled at a time in the backward: the float32 copy of a gradient is one slice at a time."""


def _scaled(d_input: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``d_input * scale`` in ``scale``'s (float32) precision, rounded to ``dtype``; a long
    ``[N, H]`` gradient is scaled in row slices, so its float32 copy never exists whole."""
    if d_input.dim() != 2 or d_input.shape[0] <= _SCALE_ROWS or d_input.dtype == scale.dtype:
        return (d_input.to(scale.dtype) * scale).to(dtype)
    out = torch.empty(d_input.shape, dtype=dtype, device=d_input.device)
    for start in range(0, d_input.shape[0], _SCALE_ROWS):
        part = d_input[start : start + _SCALE_ROWS].to(scale.dtype)
        out[start : start + _SCALE_ROWS] = part.mul_(scale)  # one float32 slice at a time
        del part
    return out


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def _flops(hidden_shape, weight_shape, *args, out_shape=None) -> int:
    grad_hidden, grad_weight = args[-3], args[-2]
    n_rows, hidden_size = hidden_shape
    # One N x H x V product for the logits, one more per gradient (computed in this forward).
    return 2 * n_rows * hidden_size * weight_shape[0] * (1 + int(grad_hidden) + int(grad_weight))


register_flops(_linear_cross_entropy_op, _flops)


def _check_inputs(hidden, weight, targets, bias, reduction, num_items_in_batch, softcap, chunk_size):
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., H], got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V, H={hidden.shape[-1]}] to match hidden {tuple(hidden.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must have shape [V={weight.shape[0]}] and dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of class indices, got {targets.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must have shape {tuple(hidden.shape[:-1])} (hidden without its last dim), "
            f"got {tuple(targets.shape)}"
        )
    devices = {t.device for t in (hidden, weight, targets, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"hidden, weight, targets and bias must be on one device, got {devices}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(
            "num_items_in_batch replaces the denominator of reduction='mean'; use one or the other"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items_in_batch: Tensor | int | None = None,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, without the full logits.

    Equals ``F.cross_entropy((hidden @ weight.T + bias).float(), targets, ignore_index=...)`` (with the
    Gemma 2 soft cap applied first when ``softcap`` is given), computed in chunks with fp32 softmax math.
    Under autocast, hidden, weight and bias are cast to the autocast dtype first, as the lm-head
    ``nn.Linear`` would be.

    Targets are **already shifted**: ``targets[..., t]`` is the token that position ``t`` predicts. For
    transformers-convention labels (aligned with ``input_ids``) pass ``shift_labels(labels)``.

    If every target is ignored, the mean is nan (0 / 0, as ``F.cross_entropy``) and the gradients are 0
    (as ``F.cross_entropy``'s backward); a zero ``num_items_in_batch`` also gives zero gradients.

    Args:
        hidden: ``[..., H]`` float16/bfloat16/float32 final hidden states.
        weight: ``[V, H]`` lm-head weight, same dtype as hidden.
        targets: ``hidden.shape[:-1]`` integer class indices in ``[0, V)`` or ``ignore_index`` (values
            outside are not checked on CUDA: checking would synchronise the host).
        bias: Optional ``[V]`` lm-head bias.
        ignore_index: Target value that carries no loss.
        softcap: Gemma 2 final-logit soft cap: ``logits = softcap * tanh(logits / softcap)``.
        reduction: ``"mean"`` (over the non-ignored targets of the whole batch) or ``"sum"``.
        num_items_in_batch: Denominator of the mean instead of the local count (int or 0-d tensor):
            the number of target tokens over all gradient-accumulation micro-batches, as in
            transformers' ``ForCausalLMLoss``.
        chunk_size: Rows per chunk; default :func:`default_chunk_size` of V.
        chunk_bytes: Instead of ``chunk_size``, the most bytes one chunk of logits may take
            (:func:`chunk_size_for_bytes`).

    Returns:
        0-d loss, float32 (float64 for float64 inputs).
    """
    device_type = hidden.device.type
    if hidden.is_floating_point() and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    _check_inputs(hidden, weight, targets, bias, reduction, num_items_in_batch, softcap, chunk_size)
    if chunk_bytes is not None:
        if chunk_size is not None:
            raise ValueError("pass chunk_size or chunk_bytes, not both")
        chunk_size = chunk_size_for_bytes(weight.shape[0], chunk_bytes, hidden.dtype)

    if num_items_in_batch is not None:
        num_items_in_batch = torch.as_tensor(num_items_in_batch, device=hidden.device).reshape(())
    grad_enabled = torch.is_grad_enabled()
    loss, *_ = torch.ops.sloth.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1).long(),
        num_items_in_batch,
        ignore_index,
        float(softcap) if softcap is not None else None,
        reduction,
        chunk_size if chunk_size is not None else default_chunk_size(weight.shape[0]),
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    return loss
