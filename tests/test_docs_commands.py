"""Every shell command in the code blocks of docs/*.md, run as ``test_readme.py`` runs the README's
(the same rules; a docs command that is also a README command runs once, in the README's test)."""

import shlex

import pytest
from test_readme import ROOT, readme_commands, run_commands, split_and


@pytest.mark.slow
def test_every_docs_command_runs(tmp_path):
    def key(line: str) -> str:  # the command as the shell splits it: spacing and comments aside
        return " && ".join(shlex.join(args) for args in split_and(line))

    in_readme = {key(line) for line, _ in readme_commands((ROOT / "README.md").read_text())}
    commands = [
        (line, needs_gpu)
        for path in sorted((ROOT / "docs").glob("*.md"))
        for line, needs_gpu in readme_commands(path.read_text())
        if key(line) not in in_readme
    ]
    ran, checked, skipped = run_commands(commands, tmp_path)
    assert len(ran) + len(checked) + len(skipped) == len(commands) and ran, commands
