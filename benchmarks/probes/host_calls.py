"""Host time of one eager call of the per-layer ops, on tensors too small for the product to matter.

A training step that is partly host-bound (the thin-layer shapes of the host-gap work) pays the
Python and dispatcher cost of every op call, per layer, in the forward and again in the recompute.
This measures that cost in isolation, on whatever device is given (the CPU works: the figures are
the host's), as the best of several blocks of calls::

    python benchmarks/probes/host_calls.py --device cpu --out host_calls.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from torch import nn


def per_call_us(fn, calls: int, blocks: int, sync) -> float:
    """Best over ``blocks`` of the mean host time of ``calls`` calls, in microseconds."""
    for _ in range(calls // 4):
        fn()
    sync()
    best = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def step_host_ms(device: torch.device, sync, blocks: int, checkpoint_impl: str = "torch") -> float:
    """Best mean time of a training step of a model too thin for its products to matter."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_sloth.data import PackedCollator
    from lightning_sloth.transform import transform_model

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, vocab_size=256, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    model.to(device)
    transform_model(model, kernels=True, checkpoint_impl=checkpoint_impl)
    gen = torch.Generator().manual_seed(1)
    samples = [(ids := torch.randint(3, 256, (n,), generator=gen).tolist(), ids) for n in (40, 30, 20, 38)]
    batch = PackedCollator(max_tokens=128, pad_token_id=0)(samples)
    inputs = {
        k: v.to(device) if torch.is_tensor(v) else v
        for k, v in (batch.model_inputs() | {"labels": batch.labels}).items()
    }
    count = torch.tensor(batch.num_target_tokens, device=device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        model(**inputs, num_items_in_batch=count).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return per_call_us(step, 10, blocks, sync) / 1e3


def main(argv: list[str] | None = None) -> dict:
    from peft import LoraConfig, get_peft_model

    from lightning_sloth.ops.lora import lora_linear_op
    from lightning_sloth.ops.lora_layers import fused_lora_forward
    from lightning_sloth.ops.registry import call
    from lightning_sloth.ops.rms_norm import rms_norm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(1)

    hidden, r = 16, 4
    layer = (
        get_peft_model(
            nn.Sequential(nn.Linear(hidden, hidden, bias=False)), LoraConfig(r=r, target_modules=["0"])
        )
        .base_model.model[0]
        .to(device)
    )
    x = torch.randn(8, hidden, device=device, requires_grad=True)
    norm_weight = torch.randn(hidden, device=device, requires_grad=True)
    w, a, b = (layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    cases = {
        "rms_norm (eager op, autograd)": lambda: rms_norm(x, norm_weight, 1e-6),
        "sloth::lora_linear through call()": lambda: call(lora_linear_op, x, w, a, b, 2.0, False),
        "fused_lora_forward (PEFT layer -> op)": lambda: fused_lora_forward(layer, x),
        "PEFT lora.Linear forward (for scale)": lambda: layer(x),
    }
    results = {name: per_call_us(fn, args.calls, args.blocks, sync) for name, fn in cases.items()}
    for name, us in results.items():
        print(f"{name:42s} {us:8.1f} us")
    step_ms = step_host_ms(device, sync, args.blocks)
    print(f"{'tiny 16-layer LoRA step (kernels=True)':42s} {step_ms:8.1f} ms")
    node_ms = step_host_ms(device, sync, args.blocks, checkpoint_impl="node")
    print(f"{'the same, checkpoint_impl=node':42s} {node_ms:8.1f} ms")
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "calls": args.calls,
        "blocks": args.blocks,
        "per_call_us": results,
        "tiny_step_ms": step_ms,
        "tiny_step_node_checkpoint_ms": node_ms,
        "tiny_step": "Llama, 16 layers, hidden 64, 4/1 heads, LoRA r=4 on all seven projections, "
        "transform_model(kernels=True), one packed row of 128 tokens (4 documents), forward + "
        "backward (checkpointed) + AdamW; best of the blocks of 10 steps",
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
