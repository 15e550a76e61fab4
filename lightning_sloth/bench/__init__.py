"""The benchmark harness: real tokens/s, peak memory and MFU of one fine-tuning workload, per system.

    python -m lightning_sloth.bench scenario=llama_3_2_1b systems=headline   # the suite (Hydra)
    python -m lightning_sloth.bench report                                    # tables + plots from JSON
    python -m lightning_sloth.bench --shape tiny --systems sloth --out r.json # the argparse harness

Rooms, each importing only those below it:

- :mod:`.suite` (the Hydra suite: probe, one fresh process per system, one JSON per run),
  :mod:`.harness` (the argparse harness) and :mod:`.report` (the generated blocks of README.md and
  docs/*.md, and their plots), which renders through :mod:`.headline` (the cross-scenario headline,
  the supported-models table) and :mod:`.tables` (one renderer per kind of result file);
- :mod:`.systems`: every system by name — lightning_sloth's, its ablations, and the peers of
  :mod:`.peers` (transformers + PEFT, Liger-Kernel, Unsloth, bitsandbytes);
- :mod:`.measure`: how one system's steps are timed, its peaks, FLOPs and gradient health;
- :mod:`.workload`: model shapes, seeded samples, padded and packed batches.
"""
