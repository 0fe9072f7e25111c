"""Packaging stays in step with the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO


def test_every_package_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO / "src").parts) for p in (REPO / "src").rglob("__init__.py")}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert "jabascli.builtin_models" in listed and (REPO / "models" / "__init__.py").is_file()


def test_solver_and_perfmodel_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, jabascli.solver, jabascli.perfmodel, jabascli.simulate, jabascli.hybrid\n"
        "for pkg in (jabascli.solver, jabascli.perfmodel, jabascli.simulate, jabascli.hybrid):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_scheduler_and_a_nodes_agent_do_not_import_torch() -> None:
    """They only start, watch and steer trainers: an agent on every node starts in a fraction of a second and
    holds no copy of torch while its trainers run."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch raises, naming the module that asked\n"
        "import jabascli.elastic.agent, jabascli.elastic.service, jabascli.elastic.job, jabascli.cli.elastic\n"
        "import jabascli.elastic.slurm\n"
    )
    _in_a_fresh_interpreter(code)


def test_the_command_line_starts_without_torch_or_paramiko() -> None:
    """Every jabas command (an agent, a worker, `jabas run` before it reads the workload) imports the whole CLI;
    paramiko alone took a fifth of that, and only `jabas sync` and remote nodes need it."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['paramiko'] = None  # an import of either raises, naming who asked\n"
        "import jabascli.cli.app\n"
    )
    _in_a_fresh_interpreter(code)


def test_what_a_launcher_checks_before_its_trainers_start_does_not_import_torch() -> None:
    """The launcher's own work (its plan, its checkpoint to resume, an fp32 job's precision) needs no torch; only
    the job's workload module, which it imports to check it, brings torch in."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import jabascli.engine.launch, jabascli.engine.rerun, jabascli.adaptive.checks\n"
        "from jabascli.engine.precision_checks import check_precision\n"
        "check_precision('fp32', 'cpu')\n"
    )
    _in_a_fresh_interpreter(code)


def test_an_agent_registering_on_a_node_without_a_gpu_driver_does_not_import_torch() -> None:
    """The agent asks detect_devices when it registers. Importing torch there cost every agent seconds, and a
    SIGTERM landing inside torch's import of numpy was swallowed, so the agent outlived its launcher."""
    import os

    from jabascli.devices import GPU_DEVICE_FILES

    if any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        pytest.skip("a GPU driver is installed here: torch.cuda is rightly asked")
    code = (
        "import sys\n"
        "from jabascli.devices import detect_devices\n"
        "found = detect_devices()\n"
        "assert found.backend == 'cpu', found\n"
        "assert 'torch' not in sys.modules, 'detect_devices imported torch'\n"
    )
    _in_a_fresh_interpreter(code)


def _in_a_fresh_interpreter(code: str) -> None:
    """Run ``code`` in a new Python (this process has long imported torch); its error, if any, fails the test."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at its top or inside a function (absolute names, as jabas writes them)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_engine_does_not_import_cli_or_elastic_and_reaches_adaptive_through_its_hooks() -> None:
    """The trainer's hook (adaptive/batching.py) and the launcher's checks (adaptive/checks.py), nothing else."""
    hooks = {"jabascli.adaptive.batching", "jabascli.adaptive.checks"}
    for path in (REPO / "src" / "jabascli" / "engine").rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith(("jabascli.cli", "jabascli.elastic")), f"{path}: imports {name}"
            if name.startswith("jabascli.adaptive"):
                assert name in hooks, f"{path}: imports {name}, not a hook"


def test_nothing_imports_cli() -> None:
    """The command line is the top floor: only it (and ``python -m jabascli``) may import it."""
    src = REPO / "src" / "jabascli"
    for path in src.rglob("*.py"):
        if path.is_relative_to(src / "cli") or path == src / "__main__.py":
            continue
        for name in _imports(path):
            assert not name.startswith("jabascli.cli"), f"{path.relative_to(REPO)}: imports {name}"


def test_no_import_circles() -> None:
    """No two modules of jabascli import each other, directly or through others (imports inside functions too)."""
    src = REPO / "src"
    modules = {
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p for p in src.rglob("*.py")
    }

    def targets(path: Path) -> set[str]:
        """The modules of jabascli ``path`` imports; ``from package import module`` names the module."""
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                found |= submodules or {node.module}
        return found & modules.keys()

    graph = {name: targets(path) - {name} for name, path in modules.items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        seen[name] = 1
        for nxt in sorted(graph[name]):
            assert seen.get(nxt) != 1, "import circle: " + " -> ".join([*path[path.index(nxt) :], nxt])
            if nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[name] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])


def test_the_library_never_prints() -> None:
    """Only the command line talks to the user: no module outside ``cli`` calls print or imports Rich or Typer
    (the library returns values or raises; child-process entry points report through their exit code)."""
    src = REPO / "src" / "jabascli"
    protocol = {src / "profiler" / "child.py"}  # a profiling child's progress lines to its parent, on stdout
    for path in src.rglob("*.py"):
        if path.is_relative_to(src / "cli") or path in protocol:
            continue
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "print", f"{where}:{node.lineno}: prints"
        for name in _imports(path):
            assert name.split(".")[0] not in ("rich", "typer"), f"{where}: imports {name}"


def test_every_module_stays_under_500_lines() -> None:
    """docs/architecture.md: a module holds one concept; one past 500 lines is split along its concepts."""
    src = REPO / "src"
    sizes = {p.relative_to(REPO): len(p.read_text().splitlines()) for p in src.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n >= 500}, "split these along their concepts"


# The names of every profile file (docs/formats.md): only ``profiles`` may spell them.
PROFILE_FILE_NAMES = (
    "max_memory_profile_info",
    "_comp_profile.json",
    "_bucket_size_profile",
    "_comm_profile_data",
    "_comm_profile_meta",
    "blocks.json",
    "device-",
    "network.json",
    "refit-",
)


def test_profiles_is_the_one_place_that_knows_file_formats() -> None:
    """docs/architecture.md: no module outside ``profiles`` names a profile file in its code (docstrings and
    help text may); every other module asks ``profiles`` for the path or the parsed content."""
    src = REPO / "src" / "jabascli"
    for path in src.rglob("*.py"):
        if path.is_relative_to(src / "profiles"):
            continue
        tree = ast.parse(path.read_text())
        prose = {  # docstrings (of modules, classes, functions and attributes) and --help text
            id(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Expr | ast.keyword) and (isinstance(node, ast.Expr) or node.arg == "help")
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                named = [name for name in PROFILE_FILE_NAMES if name in node.value]
                assert not named, f"{path.relative_to(REPO)}:{node.lineno}: names a profile file ({named[0]})"
