"""Triton kernels and their launchers, installed as ``lightning_sloth.kernels``.

In a checkout this folder sits at the repository root as ``kernels/``. Where the root is on
``sys.path`` (``python -m pytest`` or ``python -m lightning_sloth.bench`` run from it), a plain
``import kernels`` would find this folder before the ``kernels`` distribution that transformers
imports (``transformers.integrations.hub_kernels``; a dependency of transformers from 5.25), and
that import would fail. Imported under that top-level name, this file hands the name to the
installed distribution where there is one; where there is none it stays an empty package with no
``__version__``, which transformers reads as "not installed". It is otherwise empty.
"""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [entry for entry in _sys.path if _os.path.abspath(entry or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
