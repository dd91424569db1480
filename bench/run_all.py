"""`make bench`: every benchmark in bench/, one after the other, each printing its own table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

if __name__ == "__main__":
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"\n=== {script.name} ===", flush=True)
        subprocess.run([sys.executable, str(script)], check=True)
