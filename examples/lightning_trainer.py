"""Fine-tune with lightning_sloth from a plain Lightning script (no Hydra).

Builds a small Llama from a config (random weights, no download), the built-in synthetic task
with the character tokenizer, and trains a LoRA adapter on packed batches::

    python examples/lightning_trainer.py --max-steps 40

Swap in your own model (``AutoModelForCausalLM.from_pretrained(path)``), tokenizer and data
(a JSONL path, a list of records or a ``datasets.Dataset``) — the plugins stay the same.
"""

import argparse

from lightning.pytorch import Trainer, seed_everything
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_sloth import (
    CausalLMModule,
    GradientFlowGuard,
    LoraSettings,
    OptimizerSettings,
    SaveAdapter,
    SlothPrecision,
    SlothStrategy,
    SlothThroughputMonitor,
)
from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer


def main(max_steps: int, out: str) -> dict:
    seed_everything(0)
    tokenizer = build_char_tokenizer()
    data = PackedDataModule(
        tokenizer,
        train=SyntheticTask(num_samples=2000, seed=1),
        val=SyntheticTask(num_samples=64, seed=2),
        max_tokens=1024,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    module = CausalLMModule(
        LlamaForCausalLM(config),
        lora=LoraSettings(r=16, alpha=32, modules_to_save=("embed_tokens", "lm_head")),
        optimizer=OptimizerSettings(lr=3e-3, warmup_steps=5),
    )
    trainer = Trainer(
        strategy=SlothStrategy(),  # or strategy="sloth"
        plugins=[SlothPrecision("auto")],  # bf16-mixed on a bf16 GPU, 32-true on CPU
        callbacks=[SlothThroughputMonitor(), GradientFlowGuard(), SaveAdapter(f"{out}/adapter")],
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
    parser.add_argument("--out", default="outputs/example")
    args = parser.parse_args()
    print(main(args.max_steps, args.out))
