"""scheduler/ is pure Python: importing it and every module in it pulls in neither ray nor torch."""
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scheduler_imports_neither_ray_nor_torch():
    modules = sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "scheduler")]))
    assert {"policy", "token_level", "kv_blocks", "estimator"} <= set(modules)
    code = (
        "import importlib, sys\n"
        "import scheduler\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('scheduler.' + name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'numpy'))\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"scheduler pulled in: {result.stdout.strip()}"
