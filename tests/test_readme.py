"""Every shell command in the code blocks of README.md and docs/*.md, run as a user would type it.

Commands run one after another in one fresh directory per test holding the files they name.
Commands that train get overrides appended that shorten them to 2 CPU steps (a key the command
sets itself takes the short value). ``pip install`` lines are checked, not run: each requirement
parses and every extra exists in ``pyproject.toml``. ``python -m pytest`` runs with
``--collect-only``, ``python -m lightning_sloth.bench report`` with ``--check`` (no file is
rewritten). A command that needs a GPU ends with ``# gpu``; those are the only ones skipped, and
each test reports how many it ran and which it skipped. The docs' commands run in
``test_docs_commands.py`` (a file of its own, so the two run side by side under ``--dist loadfile``).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import _processes
import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPU_MARKER = re.compile(r"#\s*gpu\s*$")
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", re.S | re.M)
SHORT = {
    "trainer.accelerator": "cpu",
    "trainer.max_steps": "2",
    "trainer.val_check_interval": "2",
    "trainer.limit_val_batches": "1",
    "trainer.num_sanity_val_steps": "0",
    "trainer.samples": "2",
    "trainer.sample_max_new_tokens": "4",
    "trainer.enable_progress_bar": "false",
}
SHORT_SYNTHETIC = {"data.num_train": "32", "data.num_val": "8"}
MY_MODEL = """\
defaults:
  - /schema/model/random@_here_
  - _self_

tokenizer: char
model_type: llama
hidden_size: 32
intermediate_size: 64
num_hidden_layers: 2
num_attention_heads: 2
num_key_value_heads: 1
"""


def readme_commands(text: str) -> list[tuple[str, bool]]:
    """``(command line, needs a GPU)`` for every line of every shell code block."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append((line, bool(GPU_MARKER.search(line))))
    return commands


def split_and(line: str) -> list[list[str]]:
    """The simple commands of ``a && b``, comments removed."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts, current = [], []
    for token in lexer:
        if token == "&&":
            parts.append(current)
            current = []
        else:
            current.append(token)
    return [*parts, current]


def check_pip_install(args: list[str]) -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    requirements = [a for a in args[2:] if not a.startswith("-")]
    assert requirements, args
    for requirement in requirements:
        local = re.fullmatch(r"\.(?:\[(.*)\])?", requirement)
        if local:
            wanted = {e.strip() for e in (local.group(1) or "").split(",") if e.strip()}
            assert wanted <= extras, f"unknown extras {wanted - extras} in {requirement!r}"
        else:
            Requirement(requirement)


def collect_only(args: list[str]) -> list[str]:
    """A pytest command without its quietness and its worker options (``-n 2 --dist loadfile``):
    collected in one process with one ``-q``, it prints "N tests collected"."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-n", "--numprocesses", "--dist"):
            skip = True
        elif arg not in ("-q", "-qq", "--quiet") and not arg.startswith(("-n", "--dist=")):
            kept.append(arg)
    return kept


def shorten(args: list[str]) -> list[str]:
    overrides = dict(SHORT)
    if not any(a.startswith(("data=", "experiment=")) for a in args):
        overrides.update(SHORT_SYNTHETIC)
    kept = [a for a in args if a.split("=", 1)[0] not in overrides]
    return kept + [f"{key}={value}" for key, value in overrides.items()]


def prepare(cwd: Path) -> None:
    """The files the README's commands name."""
    from test_hf_models import make_model_dir

    records = [
        f'{{"prompt": "reverse: {w}\\n", "response": "{w[::-1]}"}}' for w in ("abc", "sloth", "lightning")
    ]
    (cwd / "my.jsonl").write_text("\n".join(records * 4) + "\n")
    make_model_dir(cwd / "models" / "llama-3.2-1b", "llama")
    (cwd / "my_conf" / "model").mkdir(parents=True)
    (cwd / "my_conf" / "model" / "my_model.yaml").write_text(MY_MODEL)


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    return _processes.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def run_commands(commands: list[tuple[str, bool]], cwd: Path) -> tuple[list[str], list[str], list[str]]:
    """Run (or check) every command in ``cwd``; returns the commands ran, the pip lines checked and
    the GPU commands skipped."""
    prepare(cwd)
    ran, checked, skipped = [], [], []
    for line, needs_gpu in commands:
        if needs_gpu:
            skipped.append(line)
            continue
        for args in split_and(line):
            program = args[0]
            if program == "pip":
                check_pip_install(args)
                checked.append(shlex.join(args))
                continue
            if program == "python":
                args = [sys.executable, *args[1:]]
            if args[1:3] == ["-m", "pytest"]:
                result = run([*collect_only(args), "--collect-only", "-q"], ROOT)
                assert result.returncode == 0 and " collected" in result.stdout, result.stdout[-2000:]
            elif args[1:3] == ["-m", "lightning_sloth.bench"]:
                if "report" in args:  # read-only here: compare README and docs with the committed JSON
                    result = run([*args, "--check"], ROOT)
                else:  # the CPU-sized suite, writing under this directory
                    result = run(args, cwd)
                assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            elif program.startswith("lightning-sloth") or args[1:3] == ["-m", "lightning_sloth.train"]:
                if program == "lightning-sloth" or program.startswith("lightning-sloth-"):
                    args = [str(BIN / program), *args[1:]]
                trains = program == "lightning-sloth" or "lightning_sloth.train" in args
                if trains and "--help" not in args:
                    args = shorten(args)
                result = run(args, cwd)
                assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"
            else:
                pytest.fail(f"command {line!r}: the test does not know how to run {program!r}")
            ran.append(shlex.join(args))
    print(f"\nran {len(ran)} commands, checked {len(checked)} pip lines, skipped {len(skipped)} (# gpu):")
    print("\n".join(f"  skipped: {line}" for line in skipped))
    assert all(GPU_MARKER.search(line) for line in skipped)
    return ran, checked, skipped


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    ran, _, _ = run_commands(readme_commands((ROOT / "README.md").read_text()), tmp_path)
    assert len(ran) >= 12, ran


def test_extractor_reads_blocks_markers_and_chains():
    text = "x\n```bash\nlightning-sloth a=1   # note\npip install -e . && b \\\n  c=2\nrun big  # gpu\n```\n"
    assert readme_commands(text) == [
        ("lightning-sloth a=1   # note", False),
        ("pip install -e . && b    c=2", False),
        ("run big  # gpu", True),
    ]
    assert split_and("pip install -e . && lightning-sloth x=1 # c") == [
        ["pip", "install", "-e", "."],
        ["lightning-sloth", "x=1"],
    ]
    assert split_and('python -m pytest -m "not gpu"') == [["python", "-m", "pytest", "-m", "not gpu"]]
    assert shorten(["lightning-sloth", "trainer.max_steps=100", "data=jsonl"])[:2] == [
        "lightning-sloth",
        "data=jsonl",
    ]
    check_pip_install(["pip", "install", "torch==2.13.0", "-e", ".[test]"])
    with pytest.raises(AssertionError, match="unknown extras"):
        check_pip_install(["pip", "install", "-e", ".[nope]"])
