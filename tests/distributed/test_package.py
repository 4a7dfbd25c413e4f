"""The package as users install it: `python -m build` makes an sdist and a
wheel (the wheel built from the sdist, so the sdist holds what a build
needs), and the installed wheel runs the README's quickstart.

The wheel goes into a directory of its own (`pip install --no-deps
--target`), put first on the path of this environment's Python, whose
TensorFlow and Keras it uses: what is tested is the wheel's own content
(every subpackage, the version, the command line), not pip's resolution of
TensorFlow. Building needs the build requirements of pyproject.toml (pip
fetches them from the package index into an isolated environment).
"""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from pure_helpers import ROOT, plain_environment, quickstart_code


def _version() -> str:
    namespace = {}
    with open(os.path.join(ROOT, "keras_distrib", "__init__.py")) as f:
        for line in f:
            if line.startswith("__version__"):
                exec(line, namespace)  # noqa: S102 (one assignment of a literal)
    return namespace["__version__"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel) built from a copy of the repository's package files."""
    source = tmp_path_factory.mktemp("source")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source)
    shutil.copytree(
        os.path.join(ROOT, "keras_distrib"),
        source / "keras_distrib",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sdist,) = glob.glob(str(out / "*.tar.gz"))
    (wheel,) = glob.glob(str(out / "*.whl"))
    return sdist, wheel


def test_sdist_and_wheel_carry_one_version_and_every_subpackage(built):
    sdist, wheel = built
    version = _version()
    assert os.path.basename(sdist) == f"keras_distrib-{version}.tar.gz"
    assert os.path.basename(wheel) == f"keras_distrib-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"keras_distrib-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in metadata
    packages = {
        os.path.relpath(d, ROOT).replace(os.sep, "/")
        for d, _, files in os.walk(os.path.join(ROOT, "keras_distrib"))
        if "__init__.py" in files
    }
    assert {f"{p}/__init__.py" for p in packages} <= names


def test_the_installed_wheel_runs_the_quickstart_and_the_launcher(built, tmp_path):
    _, wheel = built
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            wheel,
        ],
        check=True,
        timeout=300,
    )
    env = plain_environment(PYTHONPATH=str(target))
    check = (
        "import importlib.metadata, keras_distrib\n"
        "print(keras_distrib.__file__)\n"
        "print(keras_distrib.__version__, importlib.metadata.version('keras_distrib'))\n"
    )
    where, versions = subprocess.run(
        [sys.executable, "-c", check],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()[-2:]
    assert where.startswith(str(target))  # the wheel's copy, not the repository's
    assert versions.split() == [_version(), _version()]
    result = subprocess.run(
        [sys.executable, "-c", quickstart_code()],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    launcher = subprocess.run(
        [str(target / "bin" / "keras-distrib"), "launch", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert launcher.returncode == 0 and "--max_restarts" in launcher.stdout, launcher.stderr
