"""Type-check the tree as it is installed: ``python scripts/typecheck.py [mypy args]``.

The repository keeps DESIGN.md's top-level folders (shared/, services/) but installs them as
kunserve.shared / kunserve.services (pyproject's package-dir), and an editable install maps them with an
import hook that mypy cannot follow. So this builds the installed layout as a tree of symlinks in a
temporary directory, runs mypy there with the project's [tool.mypy] settings, and prints paths as they
are in the repository. Exit status: mypy's.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def link_tree(dest: pathlib.Path) -> dict[str, str]:
    """Symlinks under ``dest`` for every package-dir mapping; returns {installed path prefix: repo prefix}."""
    mapping: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    prefixes: dict[str, str] = {}
    top = dest / "kunserve"
    top.mkdir()
    for entry in (ROOT / mapping["kunserve"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in mapping.items():
        if package == "kunserve":
            continue
        installed = package.replace(".", "/")
        (dest / installed).symlink_to(ROOT / folder)
        prefixes[installed + "/"] = folder + "/"
    return prefixes


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="kunserve-typecheck-") as tmp:
        prefixes = link_tree(pathlib.Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "kunserve", *argv]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env={**os.environ, "MYPYPATH": tmp})
        for line in (proc.stdout + proc.stderr).splitlines():
            for installed, repo in prefixes.items():
                if line.startswith(installed):
                    line = repo + line[len(installed):]
                    break
            print(line)
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
