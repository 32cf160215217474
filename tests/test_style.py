"""The code keeps its style by itself: ruff's linter and formatter (settings in pyproject.toml) pass on every
Python file of the package, tests, benchmarks and examples."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["megatron_taco", "tests", "benchmarks", "examples"]
RUFF = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")

pytestmark = pytest.mark.skipif(
    RUFF is None, reason="needs ruff (pip install -e '.[dev]'; scripts/run_tests.sh installs it)"
)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run([RUFF, *command, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff {' '.join(command)} found:\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"


def test_every_module_declares_its_public_api():
    """Each module of the package names its public API in ``__all__``, and every name there exists (package
    folders whose ``__init__`` defines nothing are exempt)."""
    import importlib
    import inspect
    import pkgutil

    import megatron_taco

    missing, broken = [], []
    for info in pkgutil.walk_packages(megatron_taco.__path__, "megatron_taco."):
        module = importlib.import_module(info.name)
        public = [
            name for name, value in vars(module).items() if not name.startswith("_") and not inspect.ismodule(value)
        ]
        if info.ispkg and not public:
            continue
        if not hasattr(module, "__all__"):
            missing.append(info.name)
        broken += [f"{info.name}.{name}" for name in getattr(module, "__all__", []) if not hasattr(module, name)]
    assert not missing, f"no __all__ in {missing}"
    assert not broken, f"__all__ names what does not exist: {broken}"


# a package imports only lower layers: codecs (with their kernels) < collectives, config < Megatron/TE and MAPL hooks
# < trainer, launcher < testing helpers
LAYERS = {"codec": 0, "comm": 1, "config": 1, "megatron": 2, "mapl": 2, "training": 3, "launch": 3, "testing": 4}


def test_the_packages_import_only_layers_below_them():
    import ast
    import glob

    back_edges = []
    for path in glob.glob(os.path.join(ROOT, "megatron_taco", "**", "*.py"), recursive=True):
        source = os.path.relpath(path, os.path.join(ROOT, "megatron_taco")).split(os.sep)[0].removesuffix(".py")
        if source not in LAYERS:
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if isinstance(node, ast.ImportFrom) and node.module == "megatron_taco":  # from megatron_taco import comm
                names = [f"megatron_taco.{alias.name}" for alias in node.names]
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if parts[0] != "megatron_taco" or len(parts) < 2 or parts[1] == source:
                    continue
                if LAYERS.get(parts[1], -1) >= LAYERS[source]:
                    back_edges.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not back_edges, back_edges


def test_tacos_codec_is_a_wire_codec():
    from megatron_taco.codec import TacoCodec, WireCodec

    assert isinstance(TacoCodec(), WireCodec)


def _python_files():
    import glob

    for top in PATHS:
        for path in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True):
            if os.sep + os.path.join("benchmarks", "results") + os.sep not in path:  # recorded evidence
                yield path


def test_nothing_calls_pythons_salted_hash():
    """``hash()`` of a str or bytes changes with every process (PYTHONHASHSEED): seeds and noise drawn from it
    differ on every run (tests/test_codec.py seeded its inputs with it once). Use zlib.crc32 or a fixed seed."""
    import ast

    calls = [
        f"{os.path.relpath(path, ROOT)}:{node.lineno}"
        for path in _python_files()
        for node in ast.walk(ast.parse(open(path).read()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hash"
    ]
    assert not calls, f"hash() called at {calls}"


def _indexed_names(text: str):
    """What benchmarks/README.md names in backticks: paths, folders (``logs/x/``, ``kernels_runs/*.md``) and
    extension shorthands (```e2e.md`, `.json``: e2e.json)."""
    import re

    names = set()
    for line in text.splitlines():
        stem = None
        for token in re.findall(r"`([^`\s]+)`", line):
            if token.startswith(".") and stem:
                names.add(stem + token)
                continue
            names.add(token)
            stem = os.path.splitext(token)[0]
    return names


def test_the_benchmarks_index_names_every_script_and_result():
    """Every file in benchmarks/ and benchmarks/results/ is named in benchmarks/README.md (by its path under
    results/, its name, or a folder that holds it)."""
    bench = os.path.join(ROOT, "benchmarks")
    names = _indexed_names(open(os.path.join(bench, "README.md")).read())
    folders = {name.split("*")[0].rstrip("/") for name in names if name.endswith(("/", "/*.md"))}
    missing = []
    for folder, dirs, files in os.walk(bench):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), bench)
            under_results = os.path.relpath(path, "results")
            if name in ("README.md", "__init__.py") and folder == bench:
                continue
            parents = {os.path.dirname(under_results)} | {os.path.dirname(os.path.dirname(under_results))}
            if not ({path, under_results, name} & names or parents & folders):
                missing.append(path)
    assert not missing, f"benchmarks/README.md does not name {missing}"


def test_every_result_names_its_commit_and_date():
    """A Markdown report names its commit and date in its header (first 12 lines), a log in its first lines."""
    import re

    results = os.path.join(ROOT, "benchmarks", "results")
    unnamed = []
    for folder, _, files in os.walk(results):
        for name in files:
            if not name.endswith((".md", ".log")):
                continue
            with open(os.path.join(folder, name)) as f:
                head = "".join(f.readline() for _ in range(12 if name.endswith(".md") else 3))
            if not (re.search(r"\b[0-9a-f]{7,40}\b", head) and re.search(r"\b20\d\d-\d\d-\d\d\b", head)):
                unnamed.append(os.path.relpath(os.path.join(folder, name), results))
    assert not unnamed, f"no commit or date in the header of {unnamed}"


def test_every_mutation_still_applies():
    """benchmarks/mutations.py breaks the code by replacing exact text: each text must still be in its file once
    (code that moved on silently leaves its mutation, and the tests it checks, behind)."""
    from benchmarks import mutations

    stale = []
    for what, path, text, _, tests, _ in mutations.MUTATIONS:
        for file, old, _ in [(path, text, None)] if path else mutations.SCALE_BIAS:
            if open(os.path.join(ROOT, file)).read().count(old) != 1:
                stale.append(f"{what} ({file})")
        stale += [f"{what}: no {t}" for t in tests.split() if not os.path.exists(os.path.join(ROOT, t))]
    assert not stale, f"mutations whose text is not exactly once in its file: {stale}"
