"""The policy folder stays pure, and the packages keep their import direction.

Every module under shared/policy/ must import without protobuf, grpc, torch or a service: the policies
are driven by the services, the unit tests and a simulator alike, with plain data in and out. The check
imports each module in a fresh interpreter where those packages cannot be found, so an indirect import
(a policy importing a helper that imports torch) fails as surely as a direct one.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
FORBIDDEN = ("torch", "grpc", "google.protobuf", "kunserve.v1", "kunserve.services")

_PROBE = """
import importlib, importlib.abc, json, sys
FORBIDDEN = {forbidden!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
            raise ImportError(f"{{name}} is forbidden in a policy module")
        return None

sys.meta_path.insert(0, Block())
failures = {{}}
for mod in {modules!r}:
    try:
        importlib.import_module(mod)
    except Exception as exc:
        failures[mod] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(failures))
"""


def policy_modules() -> list[str]:
    return sorted(f"kunserve.shared.policy.{p.stem}" for p in (ROOT / "shared" / "policy").glob("*.py"))


def test_every_policy_module_imports_without_protobuf_grpc_torch_or_services():
    modules = policy_modules()
    assert "kunserve.shared.policy.router" in modules and len(modules) > 10
    out = subprocess.run([sys.executable, "-c", _PROBE.format(forbidden=FORBIDDEN, modules=modules)],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_the_probe_catches_an_indirect_import():
    """The same probe on a module known to pull torch in through another module must fail."""
    out = subprocess.run([sys.executable, "-c", _PROBE.format(forbidden=FORBIDDEN,
                                                              modules=["kunserve.shared.engine.loop"])],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "torch" in json.loads(out.stdout.strip().splitlines()[-1])["kunserve.shared.engine.loop"]


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file names in an import statement, at any depth (lazy imports count too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _offenders(folder: str, prefix: str) -> list[str]:
    return sorted(f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / folder).rglob("*.py")
                  for m in _imports(p) if m == prefix or m.startswith(prefix + "."))


def test_no_service_imports_the_cli_and_no_cli_imports_a_service():
    assert _offenders("services", "kunserve.cli") == []
    assert _offenders("kunserve/cli", "kunserve.services") == []
    assert _offenders("shared", "kunserve.cli") == [] and _offenders("shared", "kunserve.services") == []
