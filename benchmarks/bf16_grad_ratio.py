"""How close the patched model's bf16 gradients are to float32, against transformers' own bf16 ones.

For each family (llama, qwen2: q/k/v with a bias) and seed, a tiny CUDA model with LoRA on the 7
projections (``tests/gpu/test_patching_gpu.py``'s build) runs one step in float32, in bf16 as
transformers + PEFT and in bf16 patched by ``apply_kernels``. Per parameter: the relative error of
each bf16 gradient to float32 and their ratio (ours / theirs). Prints the median ratio and the three
largest per seed; the JSON goes to ``$OUT`` (else ``benchmarks/results/``)::

    python benchmarks/bf16_grad_ratio.py  # gpu
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import _models  # noqa: E402
import torch  # noqa: E402
from test_patching_gpu import SMALL, batch, build, rel, step  # noqa: E402

from lightning_sloth.patching import apply_kernels  # noqa: E402


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    records = []
    for model_type in ["llama", "qwen2"]:
        for seed in range(4):
            master = _models.add_lora(build(model_type, seed=seed))
            theirs = copy.deepcopy(master).to(torch.bfloat16)
            ours = copy.deepcopy(master).to(torch.bfloat16)
            apply_kernels(ours)
            inputs = batch(SMALL["vocab_size"], seed=seed + 1)
            _, ref = step(master, inputs)
            _, their_grads = step(theirs, inputs)
            _, our_grads = step(ours, inputs)
            rows = []
            for name, expected in ref.items():
                o, t = rel(our_grads[name], expected), rel(their_grads[name], expected)
                rows.append((o / max(t, 1e-9), name, o, t))
            rows.sort(reverse=True)
            median = sorted(r[0] for r in rows)[len(rows) // 2]
            top = "; ".join(f"{n.split('layers.')[-1]} {r:.2f} ({o:.3f}/{t:.3f})" for r, n, o, t in rows[:3])
            print(f"{model_type} seed {seed}: median ratio {median:.2f}; top: {top}")
            records.append(
                dict(
                    model_type=model_type,
                    seed=seed,
                    median=median,
                    top=[(n, r, o, t) for r, n, o, t in rows[:5]],
                )
            )
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")) / "qwen2_bias_grad_ratio.json"
    out.write_text(json.dumps(records, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
