"""The README's quickstart runs as printed.

README.md marks its quickstart with `<!-- quickstart -->` on the line before
the code fence; this test takes that block and runs it in a fresh
interpreter (the block makes its own tiny data), which must exit with 0.
Every other Python block in the README and in docs/ is an excerpt
(`<!-- excerpt -->` before its fence) and is not run.
"""

import subprocess
import sys

from pure_helpers import plain_environment, quickstart_code


def test_readme_quickstart_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", quickstart_code()],
        cwd=tmp_path,
        env=plain_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"README quickstart exited with {result.returncode}:\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
