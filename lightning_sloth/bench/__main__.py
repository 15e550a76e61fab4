"""``python -m lightning_sloth.bench``: ``report ...`` -> the report; ``--out ...`` -> the argparse
harness; anything else -> the Hydra suite."""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning_sloth.bench import harness, report, suite


def cli(argv: list[str]) -> Any:
    """Dispatch ``argv`` (without the program name) to the report, the harness or the suite."""
    if argv and argv[0] == "report":
        raise SystemExit(report.main(argv[1:]))
    if any(a == "--out" or a.startswith("--out=") for a in argv):
        return harness.main(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return suite.app(argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
