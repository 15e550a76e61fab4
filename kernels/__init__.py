"""Triton kernels and their launchers, installed as ``lightning_sloth.kernels``.

In a checkout this folder sits at the repository root as ``kernels/``. Where the root is on
``sys.path`` (``python -m pytest`` or ``python -m lightning_sloth.bench`` run from it), a plain
``import kernels`` would find this folder before the ``kernels`` distribution that transformers
imports (``transformers.integrations.hub_kernels``; a dependency of transformers since 5.2x), and
that import would fail. Imported under that top-level name, this file hands the name to the
installed distribution and is otherwise empty.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        raise ModuleNotFoundError(
            "No module named 'kernels': the repository's kernels/ folder is lightning_sloth.kernels, "
            "and no 'kernels' distribution is installed",
            name="kernels",
        )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
