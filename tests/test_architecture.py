"""The rules that keep fdp carryable (docs/architecture.md), checked on the source itself.

* Layers: each concept folder imports only the layers below it (``LAYERS``); in particular
  the plan does not import the step, the step machine imports neither the Reducer nor the
  fused step, and the cost model does not import the fused step (it is handed what it prices).
* No import cycle between fdp's modules (module-level imports).
* No module uses another module's private name: a leading underscore means "this file
  only". Modules themselves may be private (``fdp._tree``); what one module shares with
  another gets an underscore-free name. Tests and examples follow the same rule.
* The top-level layout is the project's: pyproject.toml, fdp, kernels, tests, examples, docs.
"""

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def package_modules():
    """{dotted module name: path} for fdp and fdp.kernels (kernels/ is installed as fdp.kernels)."""
    mods = {}
    for path in sorted((ROOT / "fdp").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        if "kernels" in parts and parts[0] == "fdp" and path.is_symlink():
            continue
        mods[".".join(parts)] = path
    for path in sorted((ROOT / "kernels").glob("*.py")):
        name = "fdp.kernels" if path.stem == "__init__" else f"fdp.kernels.{path.stem}"
        mods[name] = path
    return mods


MODULES = package_modules()


def resolve(current: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: pathlib.Path, top_level_only: bool):
    """(imported module, [names]) for each import statement of a file."""
    tree = ast.parse(path.read_text())
    is_package = path.stem == "__init__"
    nodes = [*tree.body, *_type_checking_imports(tree)] if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            out.append((resolve(name, is_package, node.module, node.level), [a.name for a in node.names],
                        {a.asname or a.name: a.name for a in node.names}, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.name, [], {a.asname or a.name.split(".")[0]: a.name}, node.lineno))
    return out


def _type_checking_imports(tree: ast.Module) -> list[ast.stmt]:
    """The imports in the module's top-level ``if TYPE_CHECKING:`` blocks."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += [n for n in node.body if isinstance(n, ast.Import | ast.ImportFrom)]
    return out


def test_there_is_no_import_cycle_between_modules():
    """Module-level imports, those under ``if TYPE_CHECKING:`` included (two files that import
    each other for their types only are one idea, or a missing protocol)."""
    graph = {}
    for name, path in MODULES.items():
        deps = set()
        for module, names, _, _ in imports_of(name, path, top_level_only=True):
            if module in MODULES:
                deps.add(module)
            for n in names:  # "from . import hooks" imports a module
                if f"{module}.{n}" in MODULES:
                    deps.add(f"{module}.{n}")
        graph[name] = deps - {name}

    # A package importing its own submodules (to re-export them) is not a cycle.
    def edges(m):
        return {d for d in graph[m] if not d.startswith(m + ".")}

    state, stack = {}, []

    def visit(m):
        state[m] = "active"
        stack.append(m)
        for d in edges(m):
            if state.get(d) == "active":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m)


# The layers, lowest first: a module imports only modules of its own layer or below, and
# within a layer only its own folder. Names are module prefixes.
LAYERS = [
    ("fdp._internals", "fdp._lru"),                                # the private torch APIs, each once; the one cache
    ("fdp._tree", "fdp._errors", "fdp._log", "fdp._shard", "fdp._protocols", "fdp.kernels"),  # pytrees, errors, Shard, seams, copy kernels
    ("fdp._comm",),                                                # groups, collectives, agreement, lifetime
    ("fdp._plan", "fdp.optim"),                                    # layouts in flat buckets; optimizers
    ("fdp.hooks", "fdp._sync", "fdp._replicas", "fdp._psum", "fdp._rng", "fdp._checkpoint",
     "fdp._functional", "fdp._slices"),                            # what users call beside the step; slices over ranks
    ("fdp._step",),                                                # one step over a plan
    ("fdp._units",),                                               # fully sharded params: units gathered on demand
    ("fdp._sources",),                                             # where params come from: deferred init, safetensors
    ("fdp._fused", "fdp.cost"),                                    # the fused step; the cost model
    ("fdp._reducer",),                                             # the Reducer
    ("fdp", "fdp.testing", "fdp.viz", "fdp.bench", "fdp.env"),     # the public face, tools
]


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the prefix that matched) of an fdp module: the longest prefix wins."""
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


def module_deps(name: str, path: pathlib.Path) -> set[str]:
    deps = set()
    for module, names, _, _ in imports_of(name, path, top_level_only=False):
        if module in MODULES:
            deps.add(module)
        for n in names:
            if f"{module}.{n}" in MODULES:
                deps.add(f"{module}.{n}")
    return deps - {name}


def test_every_module_imports_only_its_layer_or_below():
    wrong = []
    for name, path in MODULES.items():
        mine, my_prefix = layer_of(name)
        for dep in module_deps(name, path):
            theirs, their_prefix = layer_of(dep)
            if name.startswith(dep + ".") or dep == "fdp":  # a package's __init__ / the top package
                continue
            if theirs > mine or (theirs == mine and their_prefix != my_prefix and my_prefix != "fdp"):
                wrong.append(f"{name} (layer {mine}) imports {dep} (layer {theirs})")
    assert not wrong, "imports against the layers (LAYERS in this file): " + "; ".join(sorted(wrong))


@pytest.mark.parametrize("lower,higher", [
    ("fdp._plan", "fdp._step"), ("fdp._step", "fdp._reducer"), ("fdp._step", "fdp._fused"),
    ("fdp.cost", "fdp._fused"), ("fdp._comm", "fdp._plan"), ("fdp.optim", "fdp._fused"),
    ("fdp._units", "fdp._fused"), ("fdp._slices", "fdp._units"), ("fdp._functional", "fdp._units"),
])
def test_named_layering_rules(lower, higher):
    """The rules docs/architecture.md states by name (also implied by LAYERS)."""
    bad = [f"{n} imports {d}" for n, p in MODULES.items() if n == lower or n.startswith(lower + ".")
           for d in module_deps(n, p) if d == higher or d.startswith(higher + ".")]
    assert not bad, bad


def test_every_folder_of_the_library_says_what_it_is():
    for init in sorted((ROOT / "fdp").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 5, f"{init.relative_to(ROOT)} needs a docstring naming its concept"


def private_uses(path: pathlib.Path, name: str | None):
    """Uses of another fdp module's underscore name in one file: ``from m import _x`` and
    ``m._x`` where ``m`` is bound to an fdp module (``_x`` not itself a submodule)."""
    is_package = path.stem == "__init__"
    found = []
    aliases = {}  # local name -> fdp module it is bound to
    for module, names, bound, line in imports_of(name or "", path, top_level_only=False):
        for local, original in bound.items():
            target = f"{module}.{original}" if names else original
            if target in MODULES or (not names and original.startswith("fdp")):
                aliases[local] = target if names else original.split(".")[0]
            elif names and module in MODULES and original.startswith("_") and target not in MODULES:
                found.append(f"line {line}: from {module} import {original}")
    del is_package
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in aliases:
            continue
        dotted = aliases[base.id]
        for part in reversed(chain[1:]):
            dotted = f"{dotted}.{part}"
        if dotted in MODULES and f"{dotted}.{node.attr}" not in MODULES and dotted != name:
            found.append(f"line {node.lineno}: {dotted}.{node.attr}")
    return found


def files_to_check():
    for name, path in MODULES.items():
        yield str(path.relative_to(ROOT)), path, name
    for folder in ("tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "test_architecture.py":  # (its probe below names private names on purpose)
                yield str(path.relative_to(ROOT)), path, None


@pytest.mark.parametrize("rel,path,name", list(files_to_check()), ids=lambda v: v if isinstance(v, str) else "")
def test_no_module_uses_another_modules_private_name(rel, path, name):
    found = private_uses(path, name)
    assert not found, f"{rel} reaches into private names of other modules: {found}"


def test_the_rule_catches_a_private_name(tmp_path):
    probe = tmp_path / "probe_private_use.py"
    probe.write_text("import fdp\nfrom fdp._plan.bucket import _caps\nx = fdp._reducer._HOOK\ny = fdp._tree.flatten\n")
    found = private_uses(probe, None)
    assert found == ["line 2: from fdp._plan.bucket import _caps", "line 3: fdp._reducer._HOOK"], found


def test_the_top_level_layout_is_the_projects():
    for required in ("pyproject.toml", "fdp", "kernels", "tests", "examples", "docs"):
        assert (ROOT / required).exists(), required
    assert not (ROOT / "kernels" / "__init__.py").read_text().startswith("import fdp")
    assert '"fdp.kernels" = "kernels"' in (ROOT / "pyproject.toml").read_text()


def test_every_package_folder_is_installed():
    """pyproject.toml lists its packages one by one: a folder missing there is missing from the
    wheel (fdp/_comm, _plan, _step, _fused and cost once were)."""
    tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fdp").rglob("__init__.py")}
    assert folders - listed == set(), f"package folders pyproject.toml does not install: {sorted(folders - listed)}"


# Private torch names: torch._X (but the public-by-convention torch._foreach_* kernels), private
# submodules, underscored attributes of torch objects fdp reads, and frame introspection.
PRIVATE_TORCH = re.compile(
    r"\btorch\._(?!foreach_)[A-Za-z]|\btorch\.(?:utils|distributed|optim|nn|autograd)\._[a-z]"
    r"|\._(?:backward_hooks|version|make_subclass|get_backend|timeout|parameters|buffers|forward_pre_hooks"
    r"|forward_hooks|non_persistent_buffers_set|orig_mod|cdata|execution_engine)\b|\bsys\._getframe\b|\bmeta_path\b")


def code_lines(path: pathlib.Path) -> dict[int, str]:
    """Each line's code with its strings and comments left out (a docstring may name them)."""
    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: "".join(t) for n, t in lines.items()}


def test_no_module_but_internals_reaches_into_torch_private_names():
    found = []
    for name, path in MODULES.items():
        if name == "fdp._internals":
            continue
        for n, line in code_lines(path).items():
            for m in PRIVATE_TORCH.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not found, ("private torch APIs outside fdp/_internals.py (put each behind a name there, in its "
                       "CATALOGUE): " + "; ".join(found))


def test_the_rule_catches_a_private_torch_name(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('import torch\n"torch._C in a string"\nx = torch._C._nn\ny = t._version  # t._cdata\n'
                     'z = torch._foreach_add\n')
    assert [m.group(0) for line in code_lines(probe).values() for m in PRIVATE_TORCH.finditer(line)] == \
        ["torch._C", "._version"]


def test_every_catalogued_internal_is_a_name_of_the_module():
    from fdp import _internals

    missing = [u.name for u in _internals.CATALOGUE if not hasattr(_internals, u.name)]
    assert not missing and len({u.name for u in _internals.CATALOGUE}) == len(_internals.CATALOGUE), missing
