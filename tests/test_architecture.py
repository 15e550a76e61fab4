"""The house rules the code keeps: the import contracts of pyproject.toml, and modules of a readable size.

The contracts (``[tool.importlinter]``) are checked by ``lint-imports`` on the package laid out as
installed (``.ci/lint-imports``): the layers from the app down to the leaves, no circles among the
modules of any package (imports inside functions included), private modules imported only inside
their own package, and the model transformations free of Lightning and Hydra.
"""

import ast
import sys
from pathlib import Path

import _processes
import tomllib

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
"""A module longer than this says in its docstring why it is one file (the phrase "one file")."""


def _sources() -> list[Path]:
    return sorted([*(ROOT / "lightning_sloth").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.exists(), "import-linter is in the test extra: pip install -e '.[test]'"
    result = _processes.run(
        ["bash", str(ROOT / ".ci" / "lint-imports")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": f"{lint.parent}:/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in result.stdout
    assert {c["type"] for c in contracts} >= {"layers", "acyclic_siblings", "private_modules", "forbidden"}


def test_long_modules_say_why_they_are_one_file():
    too_long = []
    for path in _sources():
        text = path.read_text()
        if text.count("\n") <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "one file" not in doc.lower():
            too_long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not too_long, f"split these modules or say in their docstring why each is one file: {too_long}"
