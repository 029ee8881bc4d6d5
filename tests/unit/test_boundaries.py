"""The client boundary, checked on the source: nothing outside aioengine/engine/ imports
EngineCore (or its modules) or reads `.core` off an engine; the server, Ray Serve, the
benchmarks and the scripts use AsyncEngine / LLM (aioengine/engine/client.py) only.

`aioengine.sched` (the scheduler) and `aioengine.kv` (the KV cache) are other packages:
importing them, and reaching their modules as `aioengine.kv.<module>`, is fine; so is a
module path through a package that happens to be named `core`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Source folders -> the package each is installed as (pyproject's package-dir).
SOURCE_DIRS = {"aioengine": "aioengine", "spec_decode": "aioengine.spec_decode",
               "structured": "aioengine.structured", "lora": "aioengine.lora",
               "kernels": "aioengine.kernels", "scripts": "scripts"}
# The engine's own package: the one place that may reach into EngineCore.
ENGINE_PACKAGE = "aioengine.engine"
# EngineCore's modules: the core and the admission object it holds (core.admission).
CORE_MODULES = ("aioengine.engine.core", "aioengine.engine.admission")
CORE_NAMES = ("EngineCore", "RequestAdmission")


def module_name(path: Path) -> str:
    """The dotted module a source file is imported as (packages end in __init__)."""
    rel = path.relative_to(ROOT)
    parts = [SOURCE_DIRS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of a `from ... import`, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _is_core_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in CORE_MODULES)


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def boundary_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of EngineCore or its modules, and each `.core` read off an object
    (`engine.core`, `self.engine.core`, `getattr(llm, "core")`) in `source`, as
    'line: text'. `x.core` is allowed where `x` is a module imported as such and `x.core`
    a package (`aioengine.sched.scheduler` after `import aioengine.sched.scheduler`)."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> the module it is bound to by an import
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_core_module(alias.name):
                    found.append((node.lineno, ast.unparse(node)))
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    modules[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                if (_is_core_module(base) or _is_core_module(full)
                        or alias.name in CORE_NAMES):
                    found.append((node.lineno, ast.unparse(node)))
                modules[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "core":
            owner = _dotted(node.value)
            head = None if owner is None else owner.split(".")[0]
            if head in modules and _is_package(modules[head] + owner[len(head):] + ".core"):
                continue  # a module path: aioengine.core.<module>
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "core"):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Name) and node.id in CORE_NAMES:
            found.append((node.lineno, node.id))
    return [f"{line}: {text}" for line, text in sorted(set(found))]


def _is_package(dotted: str) -> bool:
    """Whether `dotted` is a package or module of this repository."""
    parts = dotted.split(".")
    for folder, package in SOURCE_DIRS.items():
        prefix = package.split(".")
        if parts[:len(prefix)] == prefix:
            path = ROOT / folder / Path(*parts[len(prefix):]) if parts[len(prefix):] \
                else ROOT / folder
            return path.is_dir() or path.with_suffix(".py").is_file()
    return False


def client_sources() -> list[Path]:
    """Every .py file outside aioengine/engine/ that the boundary applies to."""
    files = []
    for folder in SOURCE_DIRS:
        files += [p for p in sorted((ROOT / folder).rglob("*.py"))
                  if not module_name(p).startswith(ENGINE_PACKAGE + ".")
                  and module_name(p) != ENGINE_PACKAGE]
    return files


def test_the_checker_finds_what_crosses_the_boundary() -> None:
    server = "aioengine.server.serving_engine"
    crossing = {
        "n = engine.core.max_model_len": 1,
        "self.engine.core.check_token_ids(ids, 'prompt')": 1,
        "def f(ctx):\n    core = ctx.engine.core\n    return core.stats()": 1,
        "llm.core.loaded.model": 1,
        "s = getattr(llm, 'core').stats()": 1,
        "from aioengine.engine.core import EngineCore": 1,
        "from aioengine.engine import core": 1,
        "import aioengine.engine.core": 1,
        "import aioengine.engine.core as ec": 1,
        "from ..engine.core import EngineCore": 1,
        "from ..engine import admission": 1,
        "from aioengine.engine.async_engine import EngineCore": 1,
    }
    for source, count in crossing.items():
        assert len(boundary_violations(source, server)) == count, source
    allowed = [
        "from aioengine.sched.scheduler import Scheduler",
        "from aioengine.kv import kv_cache_manager",
        "import aioengine.sched.scheduler\nx = aioengine.sched.scheduler.Scheduler",
        "import aioengine\nx = aioengine.kv.kv_cache_manager.KVCacheManager",
        "from ..core.scheduler_output import EngineCoreOutput",
        "from aioengine.engine.async_engine import AsyncEngine\n"
        "x = engine.max_model_len; y = engine.stats(); z = engine.core_count",
        "core = 3\nprint(core)",
    ]
    for source in allowed:
        assert boundary_violations(source, server) == [], source


def test_nothing_outside_the_engine_reaches_into_engine_core() -> None:
    files = client_sources()
    assert len(files) > 50 and any(p.name == "api_server.py" for p in files)
    found = {}
    for path in files:
        hits = boundary_violations(path.read_text(), module_name(path),
                                   path.name == "__init__.py")
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, ("use AsyncEngine / LLM (aioengine/engine/client.py), not EngineCore: "
                       f"{found}")


@pytest.mark.parametrize("path, module", [
    ("aioengine/server/api_server.py", "aioengine.server.api_server"),
    ("spec_decode/train/cli.py", "aioengine.spec_decode.train.cli"),
    ("lora/__init__.py", "aioengine.lora"),
    ("scripts/gpu_check.py", "scripts.gpu_check"),
])
def test_module_names_follow_the_package_dirs(path: str, module: str) -> None:
    assert module_name(ROOT / path) == module
