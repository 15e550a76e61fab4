"""``sloth::rms_norm_gated`` on CUDA: the Triton kernels in bf16 at the Qwen3.5-9B shape (16k tokens,
32 value heads of 128) and an odd one, against transformers' module forward and the float32
reference gradients; and a Qwen3.5 model with the op (the default) against the same model with it off."""

import copy

import pytest
import torch

from lightning_sloth.ops.rms_norm_gated import rms_norm_gated, rms_norm_gated_backward_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(16384, 32, 128), (333, 3, 40)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_match_the_module_and_the_float32_gradients(shape, weight_dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    gen = torch.Generator(device="cuda").manual_seed(0)
    module = Qwen3_5RMSNormGated(shape[-1], eps=1e-6).cuda().to(weight_dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(shape[-1], device="cuda", generator=gen))
    x = torch.randn(*shape, device="cuda", generator=gen).bfloat16().requires_grad_()
    gate = (2 * torch.randn(*shape, device="cuda", generator=gen)).bfloat16().requires_grad_()
    y = rms_norm_gated(x, gate, module.weight, 1e-6)
    torch.testing.assert_close(y.float(), module(x, gate).float(), rtol=1.6e-2, atol=1e-2)
    grad = torch.randn(*shape, device="cuda", generator=gen).bfloat16()
    got = torch.autograd.grad(y, (x, gate, module.weight), grad)
    rstd = torch.rsqrt(x.detach().float().pow(2).mean(-1) + 1e-6)
    want = rms_norm_gated_backward_reference(grad, x.detach(), gate.detach(), module.weight.detach(), rstd)
    for g, w in zip(got, want):
        scale = w.float().abs().max().item()
        torch.testing.assert_close(g.float(), w.float(), rtol=1.6e-2, atol=1e-2 * max(scale, 1.0))


def test_a_qwen3_5_model_with_the_op_matches_it_off_in_bf16():
    from _families import tiny
    from _models import packed_batch, random_documents

    from lightning_sloth.transform import transform_model

    reference = tiny("qwen3_5_text", head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                     hidden_size=256).cuda().bfloat16()  # fmt: skip
    batch = packed_batch(random_documents([100, 37, 250], seed=2), pad_to=512).to("cuda")
    losses = []
    for on in (False, True):
        model = copy.deepcopy(reference)
        report = transform_model(model, kernels={"rms_norm_gated": on}).kernels
        assert report.counts["rms_norm_gated"] == (1 if on else 0)
        losses.append(model(**batch.model_inputs(), labels=batch.labels).loss.float())
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=0)
