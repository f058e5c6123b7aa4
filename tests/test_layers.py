"""The package's imports run one way: a module imports only modules of its own layer or below, and
the import graph has no cycle. Parsed with ``ast``, module-level and function-level imports alike."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "cudnn_fuse"

# lowest first; a module may import its own layer (no cycle) and every layer below
LAYERS = [
    # foundations: no cudnn_fuse import but each other (_native: the C extension, built from _native.c)
    {"_version", "_native", "errors", "envvars", "spec", "progress", "graphs"},
    # shape families of specs
    {"families"},
    # graphs of specs, their reference, the environment, the driver's launches, manifests; the FP8
    # GEMM (cuBLASLt) and cast kernels
    {"env", "builders", "builders.common", "builders.epilogue", "builders.conv", "builders.matmul",
     "builders.attention", "builders.backward", "reference", "launch_graphs", "manifest", "conv_gemm",
     "fp8_cast", "fp8_kernels"},
    # the cache; a device's handle; which engines may serve a graph; the build process, run by name
    {"cache", "handles", "engines", "build_process"},
    # a built plan and its launch; torch standing in for one
    {"plans", "torch_engine"},
    {"autotune"},
    # a spec's plan: memory, disk, build or tuning; FP8 GEMM plans (cuBLASLt) and FP8 attention's graphs
    {"loader", "fp8_gemm", "fp8_attention"},
    # the build process's own side: the loader in a process of its own
    {"build_child"},
    # the ops: validation, the memoized launch, the fused forward
    {"ops"},
    {"backward"},
    {"torch_ops"},
    # the public functional ops
    {"functional", "fp8"},
    {"nn"},
    {"hf"},
    {"optimize"},
    {"prewarm"},
    # the package's face, and what sits on it
    {"cudnn_fuse"},
    {"cli_autotune", "cache_cli", "demo", "benchsuite"},
    {"cli", "__main__"},
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts) or "cudnn_fuse"


def _modules() -> dict:
    """Every module of the package: its Python files, and its C extensions by their source's name."""
    mods = {_name(p): p for p in PKG.rglob("*.py")}
    return {**mods, **{_name(p): p for p in PKG.glob("*.c")}}


def _imports(name: str, path: Path, known: set) -> set:
    """The package modules ``name`` imports anywhere in its file (``from . import x``, ``from .x import
    y``, ``import cudnn_fuse.x``, ``from cudnn_fuse import x``), the package itself where it is named."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package and package != "cudnn_fuse" else []
                base = base[:len(base) - node.level + 1] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "cudnn_fuse" or node.module.startswith("cudnn_fuse.")):
                target = node.module.removeprefix("cudnn_fuse").lstrip(".")
            else:
                continue
            subs = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            hits = [s for s in subs if s in known]
            out.update(hits)
            if len(hits) < len(subs):  # names defined by ``target`` itself
                out.add(target or "cudnn_fuse")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "cudnn_fuse" or a.name.startswith("cudnn_fuse."):
                    out.add(a.name.removeprefix("cudnn_fuse").lstrip(".") or "cudnn_fuse")
    out.discard(name)
    return {m for m in out if m in known}


def _graph() -> dict:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) if path.suffix == ".py" else set() for name, path in mods.items()}


def test_every_module_has_a_layer():
    assert sorted(set(_modules()) - set(LAYER)) == []
    assert sorted(set(LAYER) - set(_modules())) == []  # a layer names no module that is gone


def test_no_module_imports_an_upper_layer():
    upward = [f"{a} (layer {LAYER[a]}) imports {b} (layer {LAYER[b]})"
              for a, targets in sorted(_graph().items()) for b in sorted(targets) if LAYER[b] > LAYER[a]]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state, cycles = {}, []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_parser_sees_function_level_and_package_imports(tmp_path):
    """The checks would pass vacuously if the parser missed imports: it finds this file's kinds."""
    src = tmp_path / "cudnn_fuse" / "mod.py"
    src.parent.mkdir()
    src.write_text("from . import a\nfrom .b import thing\nimport cudnn_fuse.c\n\ndef f():\n    from .d import x\n"
                   "    import cudnn_fuse\n    from cudnn_fuse import e\n")
    global PKG
    old, PKG = PKG, src.parent
    try:
        assert _imports("mod", src, {"a", "b", "c", "d", "e", "cudnn_fuse"}) == {"a", "b", "c", "d", "e", "cudnn_fuse"}
    finally:
        PKG = old
