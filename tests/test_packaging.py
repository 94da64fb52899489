"""The wheel a user installs holds every file of the source tree's packages.

CI installs the project in editable mode, which imports straight from the tree: a package left out
of pyproject.toml's list, or a data file its globs miss, passes every other test and breaks a
plain `pip install .` (the README's first command). So the wheel is built here, offline, from a
copy of what the build reads, and compared with the tree.
"""

import functools
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the wheel is the same on 3.10

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("pyproject.toml", "README.md")  # besides the package folders
SKIPPED = ("__pycache__",)


@functools.cache
def package_dirs() -> dict[str, str]:
    """Installed package prefix (mtad_edge/runtime) -> source folder (runtime), from pyproject."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    return {pkg.replace(".", "/"): dirs.get(pkg, pkg.replace(".", "/")) for pkg in tool["packages"]}


def top_folders() -> set[str]:
    return {folder.split("/")[0] for folder in package_dirs().values()}


def source_files(pattern: str) -> list[Path]:
    """The files under the package roots matching ``pattern``, caches left out."""
    paths = (path for top in top_folders() for path in (ROOT / top).rglob(pattern))
    return [path for path in paths if path.is_file() and not any(s in path.parts for s in SKIPPED)]


def tree_files() -> set[str]:
    """Every file under the packages' folders (data folders inside them too), named as the wheel
    would install it: under the deepest package folder that holds it."""
    folders = sorted(package_dirs().items(), key=lambda item: -len(item[1]))
    out = set()
    for path in source_files("*"):
        rel = path.relative_to(ROOT).as_posix()
        prefix, folder = next((p, f) for p, f in folders if rel.startswith(f + "/"))
        out.add(f"{prefix}/{rel[len(folder) + 1 :]}")
    return out


def test_every_package_folder_is_listed_in_pyproject():
    listed = {(ROOT / folder).resolve() for folder in package_dirs().values()}
    found = {init.parent.resolve() for init in source_files("__init__.py")}
    assert found == listed, f"packages with an __init__.py that pyproject.toml does not list: {found - listed}"


def test_the_wheel_holds_every_file_of_the_tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy(ROOT / name, src / name)
    for folder in top_folders():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns(*SKIPPED))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    proc = subprocess.run([*cmd, "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("mtad_edge-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in name}
    expected = tree_files()
    assert {"mtad_edge/models/hub/gemma3-1b.json", "mtad_edge/runtime/methods/sd.py"} <= expected
    assert expected <= shipped, f"in the tree, not in the wheel: {sorted(expected - shipped)}"
