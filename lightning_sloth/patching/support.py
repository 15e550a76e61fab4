"""The support matrix, generated from the family table and from the tests that exercise each family.

Per family (one row per ``config.model_type`` of :data:`~lightning_sloth.patching.FAMILIES`): its
packed attention, the ``sloth::`` ops its row installs and those it does not (with the reason), its
MoE experts, and which test files exercise it on the CPU and on the GPU, QLoRA and FSDP2 among them.
The README and ``docs/`` render it (``lightning_sloth.bench.report``)::

    rows = support_matrix(read_test_sources(Path("tests")))
    print(support_markdown(rows))

Which tests exercise a family is read from their sources, by rules a reader can check:

* a test file *mentions* a family when its text, or that of a helper module it imports (``_x.py``
  next to it, ``from _x import ...`` / ``import _x``), holds the family's ``model_type`` as a quoted
  string, one of its table class names, its config class name (``Phi3Config``), or ``tiny_<model_type>``;
* CPU: the mentioning files under ``tests/``; GPU: those under ``tests/gpu/``;
* QLoRA / FSDP2: a test *function* (decorators included) that mentions the family itself and
  quantises to 4 bits (``nf4``/``fp4``) / shards with FSDP (``fsdp``, any case, or a ``*fsdp*`` file);
* the matrix's own tests (files calling ``support_matrix(``) are not counted.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lightning_sloth.patching.families import FAMILIES, OP_COLUMNS, Family

__all__ = ["SupportRow", "read_test_sources", "support_markdown", "support_matrix"]

_QLORA = re.compile(r"nf4|fp4", re.IGNORECASE)
_FSDP = re.compile(r"fsdp", re.IGNORECASE)
_ARCHITECTURE_OPS = ("linear_attention", "rms_norm_gated", "mla")
_HELPER_IMPORT = re.compile(r"^\s*(?:from\s+(_\w+)\s+import|import\s+(_\w+))", re.MULTILINE)


@dataclass(frozen=True)
class SupportRow:
    """One family's support.

    Attributes:
        family: ``config.model_type``.
        packed_attention: how a packed row's documents are kept apart in its token mixers.
        sloth_ops: the ops the table installs for it (``lora`` on PEFT LoRA layers, always).
        absent: ``op: reason`` for each op its row does not take.
        moe_experts: its experts' implementation (``-`` for a dense family).
        qlora: whether a CPU or GPU test function trains it with 4-bit base weights.
        fsdp2: whether a test function shards it with FSDP.
        cpu_tests: test files under ``tests/`` that mention it.
        gpu_tests: test files under ``tests/gpu/`` that mention it.
        traits: what sets the family apart (the table's ``traits``).
    """

    family: str
    packed_attention: str
    sloth_ops: tuple[str, ...]
    absent: tuple[str, ...]
    moe_experts: str
    qlora: bool
    fsdp2: bool
    cpu_tests: tuple[str, ...]
    gpu_tests: tuple[str, ...]
    traits: tuple[str, ...]


def read_test_sources(tests_dir: Path) -> dict[str, str]:
    """``{path relative to tests_dir's parent: text}`` of every ``.py`` file under ``tests_dir``."""
    root = tests_dir.parent
    return {str(p.relative_to(root)): p.read_text() for p in sorted(tests_dir.rglob("*.py"))}


def _patterns(model_type: str, family: Family) -> list[re.Pattern]:
    names = {c for column in ("norms", "mlps", "attentions", "causal_lms", "linear_attentions",
                              "mla_attentions", "experts", "routers", "decoder_layers")
             for c in getattr(family, column)}  # fmt: skip
    prefix = family.causal_lms[0].removesuffix("ForCausalLM") if family.causal_lms else None
    if prefix:
        names |= {f"{prefix}Config", f"{prefix}TextConfig"}
    words = [re.escape(n) for n in sorted(names)] + [rf"tiny_{re.escape(model_type)}"]
    return [re.compile(rf"""["']{re.escape(model_type)}["']"""), re.compile(rf"\b(?:{'|'.join(words)})\b")]


def _mentions(text: str, patterns: list[re.Pattern]) -> bool:
    return any(p.search(text) for p in patterns)


def _with_helpers(path: str, text: str, sources: Mapping[str, str]) -> str:
    folder = path.rsplit("/", 1)[0] if "/" in path else ""
    helpers = [m.group(1) or m.group(2) for m in _HELPER_IMPORT.finditer(text)]
    parts = [text] + [sources.get(f"{folder}/{name}.py", "") for name in helpers]
    return "\n".join(parts)


def _test_functions(text: str) -> list[str]:
    """Source of every ``test_*`` function, decorators included."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append("\n".join(lines[start - 1 : node.end_lineno]))
    return out


def _packed_attention(family: Family) -> str:
    parts = ["document-causal (varlen / flex / sdpa)"]
    if "chunked attention" in family.traits:
        parts.append("chunked pieces")
    if family.linear_attentions:
        parts.append("Gated DeltaNet conv + delta rule over cu_seqlens")
    return "; ".join(parts)


def _experts(family: Family) -> str:
    if family.experts:
        return "sloth grouped GEMMs"
    return "transformers' (no table entry yet)" if family.moe else "-"


def support_matrix(
    test_sources: Mapping[str, str], families: Mapping[str, Family] = FAMILIES
) -> list[SupportRow]:
    """The support rows of every family, in table order.

    Args:
        test_sources: ``{path: text}`` of the test files (``read_test_sources``): paths starting with
            ``tests/gpu/`` are GPU tests, the other ``tests/test_*.py`` CPU tests, ``_*.py`` helpers.
        families: the family table.
    """
    rows = []
    for model_type, family in families.items():
        patterns = _patterns(model_type, family)
        cpu, gpu, qlora, fsdp2 = [], [], False, False
        for path, text in test_sources.items():
            name = path.rsplit("/", 1)[-1]
            if not name.startswith("test_") or "support_matrix(" in text:
                continue  # helpers, and the matrix's own tests (their sample sources name families)
            if not _mentions(_with_helpers(path, text, test_sources), patterns):
                continue
            (gpu if "/gpu/" in f"/{path}" else cpu).append(path)
            for function in _test_functions(text):
                if _mentions(function, patterns):
                    qlora |= bool(_QLORA.search(function))
                    fsdp2 |= bool(_FSDP.search(function)) or bool(_FSDP.search(name))
        ops = tuple(op for op, (column, _) in OP_COLUMNS.items() if getattr(family, column)) + ("lora",)
        notes = [op for op, _ in family.absent if op not in OP_COLUMNS]
        # A family without linear-attention or latent-attention layers has nothing for those ops
        # to take: not listed.
        missing = [op for op in OP_COLUMNS if op not in ops and op not in _ARCHITECTURE_OPS]
        absent = tuple(f"{op}: {family.why_absent(op)}" for op in [*missing, *notes])
        rows.append(
            SupportRow(
                family=model_type,
                packed_attention=_packed_attention(family),
                sloth_ops=ops,
                absent=absent,
                moe_experts=_experts(family),
                qlora=qlora,
                fsdp2=fsdp2,
                cpu_tests=tuple(cpu),
                gpu_tests=tuple(gpu),
                traits=family.traits,
            )
        )
    return rows


def support_markdown(rows: list[SupportRow]) -> str:
    """The rows as a Markdown table (one line per family)."""

    def tick(flag: bool) -> str:
        return "yes" if flag else "-"

    head = (
        "| family | packed attention | sloth ops | not patched | MoE experts | QLoRA | FSDP2 | tested on |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        tested = "CPU" if r.cpu_tests else ""
        if r.gpu_tests:
            tested = f"{tested} / GPU" if tested else "GPU"
        lines.append(
            f"| `{r.family}` | {r.packed_attention} | {', '.join(r.sloth_ops)} | "
            f"{'; '.join(r.absent) or '-'} | {r.moe_experts} | {tick(r.qlora)} | {tick(r.fsdp2)} | "
            f"{tested or '-'} |"
        )
    return head + "\n".join(lines) + "\n"
