"""benchmarks/fp8_step_tuning.sh: its order of runs, with a stand-in ``python`` on PATH that records
what it is asked to run (the real interpreter answers the one-liner that spells the default tile),
and that one-liner's spelling of the default tile."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _runs(tmp_path: Path, **env: str) -> list[str]:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stub = bin_dir / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
        f'echo "${{LIGHTNING_SLOTH_GLU_LORA_TILE:-default}} $*" >> {log}\n'
    )
    stub.chmod(0o755)
    environ = {**os.environ, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    subprocess.run(
        ["bash", "benchmarks/fp8_step_tuning.sh"], cwd=ROOT, env=environ, check=True, capture_output=True
    )
    return log.read_text().splitlines()


def _summary(calls: list[str]) -> list[str]:
    summary = []
    for call in calls:
        tile, args = call.split(" ", 1)
        if "lightning_sloth.bench" in args:
            tag = next(a for a in args.split() if a.startswith("tag="))
            systems = next(a for a in args.split() if a.startswith("systems.names="))
            summary.append(f"{tile} {tag} {systems}")
        elif "pytest" in args:
            summary.append("gpu tests")
    return summary


@pytest.mark.skipif(sys.platform == "win32", reason="a bash script")
def test_steps_only_times_the_pair_around_the_old_tile_then_tests(tmp_path):
    calls = _runs(tmp_path, STEPS_ONLY="1", WARMUP="4", TIMED="10")
    assert _summary(calls) == [
        "default tag=tuning_base systems.names=[sloth_kernels,sloth_fp8]",
        "64x64x4 tag=tuning_old_tile systems.names=[sloth_fp8]",
        "default tag=tuning_base_b systems.names=[sloth_kernels,sloth_fp8]",
        "gpu tests",
    ]
    assert all("scenario.workload.timed_steps=10" in c for c in calls if "lightning_sloth.bench" in c)
    assert not any("glu_lora_tiles_bench" in c or "fp8_quantize_bench" in c for c in calls)


def test_the_tuning_script_spells_the_default_tile():
    """benchmarks/fp8_step_tuning.sh compares the fastest tile with the default as its one-liner
    spells it: that spelling must be one the environment variable reads back as the default."""
    from lightning_sloth.kernels.glu import LORA_TILE, tile_from_text

    script = (ROOT / "benchmarks" / "fp8_step_tuning.sh").read_text()
    code = re.search(r'^default=\$\(python -c "(.*)"\)$', script, re.M).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert tile_from_text(out.strip()) == LORA_TILE
