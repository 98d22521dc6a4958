"""The README's quick start runs as written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_start_runs_and_serves_both_models(tmp_path):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    served = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert served == {"a", "b"}
