"""The repository's ``kernels/`` folder is ``lightning_sloth.kernels``; run from a checkout's root
(where ``python -m`` puts the root first on ``sys.path``), ``import kernels`` must still reach the
installed ``kernels`` distribution that transformers imports, not the folder."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *path: Path) -> subprocess.CompletedProcess:
    prelude = "import sys; sys.path[:0] = " + repr([str(p) for p in path]) + "\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_top_level_name_goes_to_the_installed_distribution(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("DISTRIBUTION = 'the installed one'\n")
    (fake / "layer.py").write_text("LAYER = 1\n")
    result = _run(
        "import kernels, kernels.layer\nprint(kernels.DISTRIBUTION, kernels.layer.LAYER, kernels.__file__)\n",
        ROOT,
        tmp_path / "site",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("the installed one 1 " + str(fake / "__init__.py"))


def test_without_a_distribution_the_name_is_an_empty_package_without_a_version():
    """What transformers' availability check reads as "not installed" (no ``__version__``), as the
    folder's empty package always was: it must not raise."""
    result = _run(
        "import sys\n"
        "sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
        "import kernels\n"
        "print(kernels.__file__, hasattr(kernels, '__version__'), sorted(n for n in vars(kernels) if not n.startswith('_')))\n",
        ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(ROOT / "kernels" / "__init__.py"), "False", "[]"]


def test_the_package_keeps_its_kernels():
    result = _run("import lightning_sloth.kernels.rms_norm as m; print(m.__name__)", ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lightning_sloth.kernels.rms_norm"
