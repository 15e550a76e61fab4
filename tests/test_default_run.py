"""The default run learns: a shortened ``lightning-sloth`` (LoRA on the packaged tiny base, the
synthetic instruction task) improves on what the base does, and shows it."""

import json

import pytest
from test_export import run_app


@pytest.mark.slow
def test_shortened_default_learns(tmp_path, capsys):
    out = tmp_path / "run"
    summary = run_app(
        out,
        [
            "trainer.accelerator=cpu",
            "trainer.max_steps=30",
            "trainer.val_check_interval=15",
            "trainer.num_sanity_val_steps=1",
            "trainer.samples=16",
            "trainer.checkpoint_every_n_steps=15",
            "trainer.enable_progress_bar=false",
            "data.num_val=64",
            "data.max_tokens=512",
        ],
    )
    first, last = summary["val_history"]
    chance = 1 / 100  # the character tokenizer's 100 ids
    assert last["token_acc"] > 0.5 > chance
    assert last["loss"] < first["loss"]
    assert last["generated_exact_match"] > 0.2  # whole answers, decoded greedily with the KV cache
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 15, 30]  # the sanity check is the "before" picture
    printed = capsys.readouterr().out
    assert "samples at step 30" in printed and "| prompt | expected | generated | ok |" in printed
