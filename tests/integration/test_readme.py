"""The README's quickstart runs as printed.

README.md marks its quickstart with `<!-- quickstart -->` on the line before
the code fence; this test takes that block and runs it in a fresh
interpreter (the block makes its own tiny data), which must exit with 0.
Every other Python block in the README and in docs/ is an excerpt
(`<!-- excerpt -->` before its fence) and is not run.
"""

import os
import re
import subprocess
import sys

from pure_helpers import ROOT

README = os.path.join(ROOT, "README.md")
MARKER = "<!-- quickstart -->"


def quickstart_code() -> str:
    """The Python code block right after README.md's quickstart marker."""
    with open(README) as f:
        text = f.read()
    assert text.count(MARKER) == 1, f"README.md must hold {MARKER} exactly once"
    found = re.search(re.escape(MARKER) + r"\s*\n```python\n(.*?)\n```", text, re.DOTALL)
    assert found, f"README.md has no ```python block right after {MARKER}"
    return found.group(1)


def test_readme_quickstart_runs(tmp_path):
    code = quickstart_code()
    # A plain one-process run: no cluster from the test's environment.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TF_CONFIG", "SLURM_", "KERAS_DISTRIB_", "OMPI_", "HOROVOD_"))}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"README quickstart exited with {result.returncode}:\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
