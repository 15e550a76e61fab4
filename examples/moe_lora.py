"""Fine-tune a mixture-of-experts model with LoRA on its attention and on its experts.

Builds a small Qwen3-MoE from a config (random weights, no download; 8 experts, top-2), the
built-in synthetic task with the character tokenizer, and trains LoRA adapters on the attention
projections and, through PEFT's ``target_parameters``, on every layer's experts. ``SlothStrategy``
runs the experts as grouped GEMMs with the expert LoRA inside them; ``ExpertLoadMonitor`` logs how
evenly the routers spread the tokens::

    python examples/moe_lora.py --max-steps 40

The same works for Mixtral and GPT-OSS checkpoints (``AutoModelForCausalLM.from_pretrained``).
"""

import argparse

from lightning.pytorch import Trainer, seed_everything
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from lightning_sloth import (
    CausalLMModule,
    ExpertLoadMonitor,
    GradientFlowGuard,
    LoraSettings,
    OptimizerSettings,
    SaveAdapter,
    SlothPrecision,
    SlothStrategy,
)
from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer


def main(max_steps: int, out: str) -> dict:
    seed_everything(0)
    tokenizer = build_char_tokenizer()
    data = PackedDataModule(
        tokenizer,
        train=SyntheticTask(num_samples=2000, seed=1),
        val=SyntheticTask(num_samples=64, seed=2),
        max_tokens=512,
    )
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        output_router_logits=True,  # adds the load-balancing loss (router_aux_loss_coef)
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    module = CausalLMModule(
        Qwen3MoeForCausalLM(config),
        lora=LoraSettings(
            r=16,
            alpha=32,
            target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
            target_parameters=("experts.gate_up_proj", "experts.down_proj"),
        ),
        optimizer=OptimizerSettings(lr=3e-3, warmup_steps=5),
    )
    trainer = Trainer(
        strategy=SlothStrategy(),  # moe=True: the "sloth" experts (moe=False keeps transformers')
        plugins=[SlothPrecision("auto")],
        callbacks=[ExpertLoadMonitor(every_n_steps=5), GradientFlowGuard(), SaveAdapter(f"{out}/adapter")],
        max_steps=max_steps,
        val_check_interval=max(max_steps // 2, 1),
        default_root_dir=out,
        log_every_n_steps=5,
    )
    trainer.fit(module, datamodule=data)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--out", default="outputs/moe_example")
    args = parser.parse_args()
    print(main(args.max_steps, args.out))
