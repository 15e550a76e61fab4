"""GPU checks of the MoE families beyond Qwen3-MoE/Mixtral/GPT-OSS: each new router in bf16 against
transformers' rule in float64, each family's MoE block (router, grouped experts with LoRA, shared
expert) in bf16 against transformers + PEFT in float64 on the same bf16-rounded weights, DeepSeek-V3's
MLA through the varlen backend (values narrower than queries) against each document alone, and
no host sync in a training step of the group-limited and the Llama 4 blocks.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_moe_families_gpu.py`` (about a minute).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _models import packed_batch, random_documents  # tests/_models.py: tests/ is on sys.path (conftest)
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_sloth.attention import set_packed_attention_backend
from lightning_sloth.moe.fused import fused_permutation_setting, set_fused_permutation
from lightning_sloth.moe.routing import ROUTERS
from lightning_sloth.patching import apply_experts
from lightning_sloth.transform import transform_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN = 64
_COMMON = dict(
    vocab_size=256,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.2,
    attn_implementation="sdpa",
)
_GROUPED = dict(
    n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5
)
CONFIGS = {
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
        shared_expert_intermediate_size=80, norm_topk_prob=False,
    ),
    "qwen3_next": dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
        shared_expert_intermediate_size=80, norm_topk_prob=True, layer_types=["full_attention"] * 2,
    ),
    "qwen3_5_moe_text": dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, layer_types=["full_attention"] * 2,
    ),
    "glm4_moe": dict(
        head_dim=16, moe_intermediate_size=48, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=False, **_GROUPED,
    ),
    "deepseek_v3": dict(
        moe_intermediate_size=48, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, num_key_value_heads=4, **_GROUPED,
    ),
    "llama4_text": dict(
        head_dim=16, num_local_experts=8, num_experts_per_tok=1, intermediate_size=48, intermediate_size_mlp=96,
        interleave_moe_layer_step=2, attention_chunk_size=512,
    ),
}  # fmt: skip
FAMILIES = list(CONFIGS)
LORA = dict(r=8, lora_alpha=16, init_lora_weights=False)
EXPERT_LORA = ["experts.gate_up_proj", "experts.down_proj"]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _model(family: str, seed: int = 0, **overrides):
    """bf16-rounded random weights, float32 on the GPU (score-correction biases spread)."""
    config = AutoConfig.for_model(family, **{**_COMMON, **CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    return model.to(torch.bfloat16).float().cuda().eval()


def _block(model):
    layer = model.model.layers[-1]
    return getattr(layer, "mlp", None) or layer.feed_forward


def _router(block):
    return getattr(block, "gate", None) or block.router


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_router_matches_transformers_rule_in_float64(family):
    """Our router on a bf16 model (float32 logits) against transformers' router in float64 on the same
    bf16 values: the same experts for every token but near-ties, and the same weights."""
    model = _model(family)
    block = _block(model)
    router = _router(block)
    x = torch.randn(2048, HIDDEN, device="cuda").bfloat16()
    reference = copy.deepcopy(router).double()
    if family == "llama4_text":
        scores, _ = reference(x.double())
        ref_weights, ref_index = torch.topk(scores, 1, dim=-1)
    else:
        _, ref_weights, ref_index = reference(x.double())
    apply_experts(model.to(torch.bfloat16))
    config = model.config
    if family == "llama4_text":
        logits = torch.nn.functional.linear(x.float(), router.weight.float())
        weights, index = ROUTERS[family](logits, config, router)
    else:
        logits, weights, index = router(x)
    assert logits.dtype == torch.float32 and weights.dtype == torch.float32
    same = (index.sort(-1).values == ref_index.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.995
    order = lambda w, i: w.gather(1, i.argsort(-1))  # noqa: E731
    got, want = order(weights, index)[same], order(ref_weights, ref_index)[same]
    assert _rel(got, want) < 1e-5


def _peft_block_pair(family):
    """(reference float64 model with PEFT's own expert LoRA, bf16 model with ours), same weights."""
    targets = ["o_proj"]
    config = LoraConfig(target_modules=targets, target_parameters=EXPERT_LORA, **LORA)
    ours = get_peft_model(_model(family, seed=1), config)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "lora_" in name:
                param.copy_(param.bfloat16().float())
    reference = copy.deepcopy(ours).double()
    if family != "llama4_text":
        reference.base_model.model.set_experts_implementation("eager")
    ours = ours.to(torch.bfloat16)
    apply_experts(ours)
    return reference, ours


@pytest.fixture(params=[False, True], ids=["separate", "fused"])
def permutation(request):
    """Both experts paths: the separate gather/combine passes and the permutation fused into the GEMMs
    (``lightning_sloth.moe.fused``; Llama 4 keeps the separate passes either way)."""
    before = fused_permutation_setting()
    set_fused_permutation(request.param)
    yield request.param
    set_fused_permutation(before)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_moe_block_with_expert_lora_matches_float64_transformers_and_peft(family, permutation):
    """The MoE block (router, grouped experts with LoRA, shared expert) in bf16 against transformers +
    PEFT in float64: output, and the gradients of the input, the router and every LoRA factor."""
    reference, ours = _peft_block_pair(family)
    ref_block, block = _block(reference.base_model.model), _block(ours.base_model.model)
    x = torch.randn(1, 333, HIDDEN, device="cuda").bfloat16()
    grad = torch.randn(1, 333, HIDDEN, device="cuda")
    results = []
    for mod, dtype in ((ref_block, torch.float64), (block, torch.bfloat16)):
        xx = x.to(dtype).requires_grad_()
        out = mod(xx)
        out = out[0] if isinstance(out, tuple) else out
        out = out.reshape(1, 333, HIDDEN)
        params = {n: p for n, p in mod.named_parameters() if p.requires_grad}
        grads = torch.autograd.grad(out, [xx, *params.values()], grad.to(out.dtype))
        results.append((out, dict(zip(["x", *params], grads, strict=True))))
    (ref_out, ref_grads), (out, grads) = results
    assert _rel(out, ref_out) < 2e-2
    assert grads.keys() == ref_grads.keys() and any("experts" in n and "lora" in n for n in grads)
    for name, ref_grad in ref_grads.items():
        assert _rel(grads[name], ref_grad) < 3e-2, name


def test_mla_packed_through_varlen_equals_each_document_alone():
    """DeepSeek-V3's MLA (query/key heads of 48, value heads of 32) on a packed row through the varlen
    backend, bf16, against the unmodified model in float64 on each document; and against the sdpa
    backend on the same row. Both layers dense (``first_k_dense_replace=2``): in bf16 a routing
    near-tie would flip an expert and hide what this checks."""
    reference = _model("deepseek_v3", first_k_dense_replace=2).double()
    lengths = [37, 1, 129, 64, 80]
    docs = random_documents(lengths, seed=2, vocab=256)
    inputs = {
        k: (v.cuda() if torch.is_tensor(v) else v)
        for k, v in packed_batch(docs, pad_to=320).model_inputs().items()
    }
    packed = copy.deepcopy(reference).to(torch.bfloat16)
    transform_model(packed, kernels=True, gradient_checkpointing=False)
    outs = {}
    try:
        for backend in ("varlen", "sdpa"):
            set_packed_attention_backend(backend)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("error")  # a backend that cannot serve the input warns and falls back
                outs[backend] = packed(**inputs).logits[0].float()
    finally:
        set_packed_attention_backend("auto")
    assert _rel(outs["varlen"], outs["sdpa"]) < 1e-2
    start = 0
    with torch.no_grad():
        for doc in docs:
            alone = reference(input_ids=torch.tensor([doc], device="cuda")).logits[0]
            assert _rel(outs["varlen"][start : start + len(doc)], alone) < 2e-2
            start += len(doc)


@pytest.mark.parametrize("family", ["deepseek_v3", "llama4_text"])
def test_no_host_sync_in_a_training_step_of_the_block(family, permutation):
    """Group-limited routing (DeepSeek-V3) and Llama 4's block, with LoRA on the experts: forward,
    backward and a capturable optimizer step under ``set_sync_debug_mode("error")``."""
    _, ours = _peft_block_pair(family)
    block = _block(ours.base_model.model)
    params = [p for p in block.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, capturable=True, foreach=True)
    x = torch.randn(1, 512, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # warm up (kernel compilation, allocator)
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
