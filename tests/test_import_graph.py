"""No import cycle among taco_jax's modules, package `__init__` files counted.

Read statically (ast), module-level imports only (a function's own import runs when it is
called, once the modules are loaded). An import of a.b.c runs the `__init__` of every
package on its path that is not already running: for a module inside package a.b, a and
a.b have started before its first line, so `from a.b import sibling` only loads the
sibling, whereas `from a.b import name` (a name its `__init__` defines) needs that
`__init__` to have run, and so depends on it."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "taco_jax"


def modules() -> dict:
    """Module name → its file, taco_jax's modules and packages (a package by its name)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _top_level(tree):
    """The statements that run when the module is imported: the module's own, and those in
    its module-level if / try blocks (not in functions or classes)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + [s for h in node.handlers for s in h.body] + node.orelse
            todo += node.finalbody


def imports(name: str, path: Path, known: dict, nested: bool = False) -> set:
    """The taco_jax modules that importing `name` runs first (see the module docstring);
    nested: also those its functions and classes import when they run (what a call of it
    can reach)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    if is_pkg:
        ancestors.add(name)
    deps = set()

    def load(target: str):
        """Importing `target` runs each package on its path not already running."""
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in known and mod not in ancestors:
                deps.add(mod)

    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if nested else _top_level(tree)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                load(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            load(source)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    load(sub)
                elif source in known:      # a name defined by the package's __init__
                    deps.add(source)
    deps.discard(name)
    return deps


def import_graph(nested: bool = False) -> dict:
    """Module → the taco_jax modules it imports (`imports`)."""
    known = modules()
    return {name: imports(name, path, known, nested) for name, path in known.items()}


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module, and self-loops
    (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_package_inits_and_relative_imports(tmp_path):
    pkg = tmp_path / "taco_jax" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "taco_jax" / "__init__.py").write_text("from taco_jax import a\n")
    (pkg / "__init__.py").write_text("from taco_jax.a.x import f\n")
    (pkg / "x.py").write_text("from . import y\nfrom taco_jax.a import f\n"
                              "def g():\n    import taco_jax.b\n")
    (pkg / "y.py").write_text("import taco_jax.b\n")
    (tmp_path / "taco_jax" / "b.py").write_text("from taco_jax.a import y\n")
    known = {}
    for path in sorted((tmp_path / "taco_jax").rglob("*.py")):
        parts = path.relative_to(tmp_path).with_suffix("").parts
        known[".".join(p for p in parts if p != "__init__")] = path
    graph = {n: imports(n, p, known) for n, p in known.items()}
    assert graph["taco_jax.a.x"] == {"taco_jax.a.y", "taco_jax.a"}   # f: the __init__'s name
    assert graph["taco_jax.b"] == {"taco_jax.a", "taco_jax.a.y"}     # a's __init__ runs first
    assert graph["taco_jax.a.y"] == {"taco_jax.b"}                   # not g's import
    assert imports("taco_jax.a.x", known["taco_jax.a.x"], known, nested=True) == {
        "taco_jax.a.y", "taco_jax.a", "taco_jax.b"}                     # g's import too
    assert cycles(graph) == [["taco_jax.a", "taco_jax.a.x", "taco_jax.a.y", "taco_jax.b"]]


def test_no_import_cycle_in_taco_jax():
    found = cycles(import_graph())
    assert not found, "import cycles among taco_jax modules: " + "; ".join(
        " <-> ".join(c) for c in found)
