"""The support matrix: generated from the family table and the sources of the tests, one row per family."""

from pathlib import Path

from lightning_sloth.patching import FAMILIES, read_test_sources, support_markdown, support_matrix

TESTS = Path(__file__).resolve().parent


def test_every_family_has_a_row_and_the_new_ones_are_tested_on_cpu():
    rows = {r.family: r for r in support_matrix(read_test_sources(TESTS))}
    assert list(rows) == list(FAMILIES)
    for family in ("phi3", "smollm3", "olmo2", "olmo3", "granite", "ministral3", "llama4_text", "gemma4_text",
                   "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):  # fmt: skip
        assert "tests/test_families_dense.py" in rows[family].cpu_tests, family
    assert "tests/gpu/test_linear_attention_gpu.py" in rows["qwen3_5_text"].gpu_tests
    assert rows["olmo2"].qlora and rows["llama"].qlora and not rows["phi3"].qlora
    assert rows["llama"].fsdp2 and rows["qwen3_5_text"].fsdp2 and not rows["phi3"].fsdp2
    assert (
        "linear_attention" in rows["qwen3_next"].sloth_ops
        and "linear_attention" not in rows["phi3"].sloth_ops
    )
    assert any(a.startswith("rope: interleaved complex rotary") for a in rows["llama4_text"].absent)
    assert rows["mixtral"].moe_experts == "sloth grouped GEMMs" and rows["gemma4_text"].moe_experts == "-"


def test_mentions_follow_the_stated_rules():
    sources = {
        "tests/_helper.py": "CASES = {'phi3': 1}\n",
        "tests/test_a.py": "from _helper import CASES\n\ndef test_plain():\n    pass\n",
        "tests/test_b.py": "def test_q():\n    build('granite', quantize='nf4')\n\ndef test_other():\n    tiny_qwen3()\n",
        "tests/gpu/test_c.py": "import torch\nfrom transformers import GraniteConfig\n",
        "tests/test_d.py": "x = 'qwen3_5_text'\n",  # not "qwen3"
        "tests/test_e.py": "support_matrix(sources)  # 'phi3' nf4\n",  # a test of the matrix: not counted
    }
    rows = {r.family: r for r in support_matrix(sources)}
    assert rows["phi3"].cpu_tests == ("tests/test_a.py",) and not rows["phi3"].qlora
    assert rows["granite"].cpu_tests == ("tests/test_b.py",) and rows["granite"].qlora
    assert rows["granite"].gpu_tests == ("tests/gpu/test_c.py",)
    assert rows["qwen3"].cpu_tests == ("tests/test_b.py",) and not rows["qwen3"].qlora
    assert rows["qwen3_5_text"].cpu_tests == ("tests/test_d.py",)
    text = support_markdown(support_matrix(sources))
    assert text.count("\n") == 2 + len(FAMILIES)
    assert "| `granite` |" in text and "CPU / GPU" in text
