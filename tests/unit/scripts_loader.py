"""Load repo scripts (not installed as packages) by path."""

import importlib.util
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script(relative_path: str, module_name: str) -> types.ModuleType:
    """The script at `relative_path` (from the repository root), imported as `module_name` (importing runs no main)."""
    spec = importlib.util.spec_from_file_location(module_name, ROOT / relative_path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_gen_protos() -> types.ModuleType:
    return load_script("scripts/gen_protos.py", "gen_protos")
