"""CUDA graphs of the checkpointed layers (``cuda_graphs=True``): replays give eager's losses and
gradients step after step, with different batches of one shape, with offload, with gradient
accumulation, with a new shape mid-run, with MoE layers (LoRA on the experts, the fused permutation
and the separate passes), and without a device sync once captured.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_cuda_graphs_gpu.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _models import VOCAB, add_lora, random_documents, tiny_llama, tiny_qwen3

from lightning_sloth.data import PackedCollator
from lightning_sloth.transform import transform_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENS = 512
LAYERS = 3
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=TOKENS,
)


def _model(family: str, dtype: torch.dtype = torch.float32):
    make = tiny_qwen3 if family == "qwen3" else tiny_llama
    overrides = dict(SHAPE, head_dim=16) if family == "qwen3" else SHAPE
    model = add_lora(make(seed=0, **overrides)).to("cuda")
    if dtype != torch.float32:  # bf16 base weights, float32 adapters (PEFT's mixed setup)
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(dtype)
    return model.train()


def _moe_model(dtype: torch.dtype = torch.float32):
    """A tiny Qwen3-MoE causal LM (8 experts, top-2) with PEFT LoRA on attention and on both expert
    weights (``target_parameters``), non-zero ``lora_B``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        **dict(SHAPE, head_dim=16),
        vocab_size=VOCAB,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.15,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model = model.to("cuda")
    if dtype != torch.float32:
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(dtype)
    return model.train()


def _batches(steps: int, seed: int = 0, longest: int = 100, tokens: int = TOKENS):
    collate = PackedCollator(tokens, 0, pad_to="max_tokens", segments_bucket="pow2")
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        lengths, total = [], 0
        while True:
            n = int(torch.randint(20, longest + 1, (), generator=gen))
            if total + n > tokens - 8:
                break
            lengths.append(n)
            total += n
        docs = random_documents(lengths, seed=seed * 1000 + step)
        batches.append(collate([(d, d) for d in docs]))
    return batches


def _train(model, batches, accumulate: int = 1, autocast: torch.dtype | None = None):
    """Losses (device tensors) and, per optimizer step, the trainable gradients before the step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    losses, grads = [], []
    for i, batch in enumerate(batches):
        b = batch.to("cuda")
        with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = model(**b.model_inputs(), labels=b.labels).loss
        (loss / accumulate).backward()
        losses.append(loss.detach())
        if (i + 1) % accumulate == 0:
            grads.append({n: p.grad.detach().clone() for n, p in zip(names, params) if p.grad is not None})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.stack(losses), grads


def _pair(family="llama", dtype=torch.float32, **settings):
    eager = _model(family, dtype)
    graphed = copy.deepcopy(eager)
    transform_model(eager, kernels=True, **settings)
    report = transform_model(graphed, kernels=True, cuda_graphs=True, **settings)
    return eager, graphed, report.checkpointing.graphs


def _expected(batches) -> tuple[int, int, int]:
    """Captures, replays and eager layer calls the graphs should count for these steps: the first
    step runs eagerly (the warm-up of the input layout), each key's first later step captures both
    graphs of every layer, and every step after the first replays them."""
    keys, captures, replays, eager = set(), 0, 0, 0
    for i, b in enumerate(batches):
        if i == 0:
            eager += LAYERS
            continue
        key = (b.cu_seqlens.shape[0], b.max_seqlen)
        if key not in keys:
            keys.add(key)
            captures += 2 * LAYERS
        replays += 2 * LAYERS
    return captures, replays, eager


def _assert_counts(graphs, batches) -> None:
    assert (graphs.captures, graphs.replays, graphs.eager_calls) == _expected(batches)
    assert graphs.replays > 0


def _assert_same(got, want, rtol=1e-5, atol=1e-6):
    (got_losses, got_grads), (want_losses, want_grads) = got, want
    torch.testing.assert_close(got_losses, want_losses, rtol=rtol, atol=atol)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        assert g.keys() == w.keys()
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_replays_match_eager_across_batches(family):
    eager, graphed, graphs = _pair(family)
    batches = _batches(5)
    want = _train(eager, batches)
    got = _train(graphed, batches)
    _assert_same(got, want)
    _assert_counts(graphs, batches)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-permutation", "separate-passes"])
def test_moe_layers_replay_like_eager(fused):
    """MoE layers (LoRA on the experts, routers and grouping on the device) are graphed like dense
    ones: the routing is sync-free and its buffers are sized from static bounds, so one capture per
    key replays every later batch; losses and every trainable gradient equal eager's."""
    from lightning_sloth.moe.fused import fused_permutation_setting, set_fused_permutation

    before = fused_permutation_setting()
    set_fused_permutation(fused)
    try:
        eager = _moe_model()
        graphed = copy.deepcopy(eager)
        report = transform_model(eager, kernels=True)
        assert report.experts.implementation == "sloth"
        graphs = transform_model(graphed, kernels=True, cuda_graphs=True).checkpointing.graphs
        batches = _batches(5, seed=8)
        want = _train(eager, batches)
        got = _train(graphed, batches)
        assert any(".experts." in name and "lora_" in name for name in want[1][0])
        _assert_same(got, want)
        _assert_counts(graphs, batches)
        eager_b = _moe_model(torch.bfloat16)
        graphed_b = copy.deepcopy(eager_b)
        transform_model(eager_b, kernels=True)
        graphs_b = transform_model(graphed_b, kernels=True, cuda_graphs=True).checkpointing.graphs
        batches = _batches(4, seed=9)
        want = _train(eager_b, batches, autocast=torch.bfloat16)
        got = _train(graphed_b, batches, autocast=torch.bfloat16)
        _assert_same(got, want, rtol=2e-2, atol=2e-3)
        _assert_counts(graphs_b, batches)
    finally:
        set_fused_permutation(before)


def test_replays_match_eager_with_offload():
    eager, graphed, graphs = _pair(offload="on")
    batches = _batches(4, seed=1)
    _assert_same(_train(graphed, batches), _train(eager, batches))
    _assert_counts(graphs, batches)


def test_gradient_accumulation_and_bf16_autocast():
    eager, graphed, graphs = _pair(dtype=torch.bfloat16)
    batches = _batches(6, seed=2)
    want = _train(eager, batches, accumulate=2, autocast=torch.bfloat16)
    got = _train(graphed, batches, accumulate=2, autocast=torch.bfloat16)
    _assert_same(got, want, rtol=2e-2, atol=2e-3)
    _assert_counts(graphs, batches)


def test_a_new_key_is_captured_at_its_first_call():
    eager, graphed, graphs = _pair()
    # Short documents, then long ones: max_seqlen's bucket changes (a new key) at step 4.
    batches = _batches(3, seed=3, longest=60) + _batches(3, seed=4, longest=250)
    assert len({(b.cu_seqlens.shape[0], b.max_seqlen) for b in batches}) > 1
    _assert_same(_train(graphed, batches), _train(eager, batches))
    _assert_counts(graphs, batches)


def test_no_device_sync_once_captured():
    _, graphed, graphs = _pair()
    batches = [_batches(1, seed=5)[0]] * 5  # one key throughout
    _train(graphed, batches[:2])  # warm-up and capture (a capture synchronizes once)
    captures, replays = graphs.captures, graphs.replays
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _train(graphed, batches[2:])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert graphs.captures == captures and graphs.replays == replays + 2 * LAYERS * 3


def test_dropout_is_refused():
    model = add_lora(tiny_llama(seed=0, attention_dropout=0.1)).to("cuda")
    with pytest.raises(ValueError, match="attention_dropout"):
        transform_model(model, kernels=True, cuda_graphs=True)


def _fit_with_trainer(tmp_path, cuda_graphs: bool, max_steps: int, ckpt_path=None):
    from lightning.pytorch import Callback, Trainer, seed_everything
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothPrecision, SlothStrategy
    from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer

    class Losses(Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    seed_everything(0)
    tokenizer = build_char_tokenizer()
    datamodule = PackedDataModule(
        tokenizer,
        train=SyntheticTask(96, seed=1),
        val=SyntheticTask(16, seed=2),
        max_tokens=512,
        pad_to="max_tokens",
        segments_bucket="pow2",
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    module = CausalLMModule(
        LlamaForCausalLM(config), lora=LoraSettings(r=8), optimizer=OptimizerSettings(lr=1e-3)
    )
    losses = Losses()
    strategy = SlothStrategy(kernels=True, cuda_graphs=cuda_graphs)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        plugins=[SlothPrecision("bf16-mixed")],
        max_steps=max_steps,
        val_check_interval=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[losses],
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer, losses.losses, strategy.sloth_report.checkpointing.graphs


def test_trainer_with_cuda_graphs_trains_like_eager_and_resumes(tmp_path):
    _, want, _ = _fit_with_trainer(tmp_path / "eager", cuda_graphs=False, max_steps=6)
    trainer, got, graphs = _fit_with_trainer(tmp_path / "graphs", cuda_graphs=True, max_steps=6)
    assert len(got) == len(want) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)
    assert graphs.replays > 0 and graphs.captures > 0  # validation ran in between, eagerly
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    last = trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    resumed, more, graphs = _fit_with_trainer(
        tmp_path / "graphs", cuda_graphs=True, max_steps=8, ckpt_path=last
    )
    assert resumed.global_step == 8 and len(more) == 2 and all(map(math.isfinite, more))


def test_loss_on_target_rows_matches_and_never_syncs():
    """The fused loss given ``num_target_tokens`` (logits for target rows only): the loss and
    gradients of the whole-row loss, and no device sync (the rows come from a sort on the GPU)."""
    batch = _batches(1, seed=7)[0].to("cuda")
    results = []
    for rows in (None, batch.num_target_tokens):
        model = _model("llama", torch.bfloat16)
        transform_model(model, kernels=True)
        extra = {} if rows is None else {"num_target_tokens": rows}
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error" if rows is not None else previous)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch.model_inputs(), labels=batch.labels, **extra).loss
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (want_loss, want), (loss, got) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=1e-3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-3)
