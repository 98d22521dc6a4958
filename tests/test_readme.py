"""The README's engine quick start runs as written, and every `tokenmux` command it shows parses."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _tokenmux_commands() -> list[list[str]]:
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("tokenmux"):
                commands.append(words[1:])
    return commands


def test_quick_start_runs_and_serves_both_models(tmp_path):
    code = next(block for block in _blocks("python") if "from actors.engine import" in block)
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    served = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert served == {"a", "b"}


def test_the_readme_shows_tokenmux_commands():
    assert len(_tokenmux_commands()) >= 10


@pytest.mark.parametrize("argv", _tokenmux_commands(), ids=" ".join)
def test_every_tokenmux_command_in_the_readme_parses(argv):
    build_parser().parse_args(argv)   # an unknown command or option exits with status 2
