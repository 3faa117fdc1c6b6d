"""Packaging facts a fresh install depends on."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_directory_is_installed():
    mapping = PY["tool"]["setuptools"]["package-dir"]
    listed = set(PY["tool"]["setuptools"]["packages"])
    found = set()
    for pkg, directory in mapping.items():
        base = ROOT / directory
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    missing = sorted(found - listed)
    assert not missing, f"add these packages to [tool.setuptools].packages: {missing}"


def test_torch_is_pinned_to_the_cpu_build():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert "torch==2.13.0" in PY["project"]["dependencies"]


def test_gpu_packages_are_optional():
    deps = " ".join(PY["project"]["dependencies"])
    assert "flashinfer" not in deps and "cuda-python" not in deps
    assert any("flashinfer" in d for d in PY["project"]["optional-dependencies"]["gpu"])


def test_console_scripts_resolve():
    import importlib

    for name, target in PY["project"]["scripts"].items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make test" in (ROOT / "README.md").read_text()
