"""Generate docs/api.md from the docstrings, and docs/architecture.md's table of torch internals
from ``fdp._internals.CATALOGUE``: ``python docs/gen_api.py [--check]``.

The API reference is the code's own text: each public name's signature and docstring, and
for classes their public methods and properties, in the sections below. Hand-written prose
(concepts, migration, performance) lives in the other pages. ``--check`` exits 1 when
docs/api.md differs from what the code would generate; tests/test_docs.py makes the same
comparison, and runs the ``>>>`` examples of everything ``documented()`` lists as doctests.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import textwrap
import types
from pathlib import Path

DOCS = Path(__file__).resolve().parent

INTRO = """\
# API reference

Generated from the docstrings by `python docs/gen_api.py` (the test suite checks it is
current): edit the code's docstrings, not this page. For the ideas behind the names see
[concepts.md](concepts.md); for a whole training loop, the [README](../README.md) and
`examples/`; for the library's layout, [architecture.md](architecture.md).

Conventions used throughout:

* **Pytrees.** Params, buffers, gradients and optimizer states are pytrees of tensors: usually
  the `dict[str, Tensor]` that `fdp.functionalize` returns, but any nesting of dicts, lists,
  tuples and NamedTuples works. fdp keeps dicts in *insertion* order (the model's
  registration order), and names a leaf by its path, e.g. `['fc.weight']` or
  `.exp_avg['fc.bias']`.
* **Collectives.** A function marked *collective* must be called by every rank of the group,
  in the same order. `group=None` means the world (the torchrun job), or a world of one when
  the script runs as plain `python` (every collective is then the identity).
* **Errors.** fdp's own exceptions are subclasses of `RuntimeError`:
  `fdp.ReplicaMismatchError`, `fdp.CollectiveError`, `fdp.CheckpointError`. Bad arguments raise
  `ValueError` or `TypeError`. Messages name the leaf path, the ranks and what was expected.
  [errors.md](errors.md) lists what fdp checks.
* **Examples.** `>>>` examples are doctests: the test suite runs them in a world of one with
  `fdp`, `torch`, `nn` (`torch.nn`) and `F` (`torch.nn.functional`) imported (`...` in a
  shown output matches anything).

```python
import torch
import fdp
```
"""

OUTRO = """\
## Environment variables

`python -m fdp.env` prints what fdp sees (versions, devices, the backend `fdp.init()` picks,
the world, threads, kernels) and each of these with its value or default.

* `FDP_DEBUG=1`: debug mode for every Reducer (a fingerprint check before each bucket
  collective and, with `shard="params"`, each unit's gather; see
  [concepts.md](concepts.md#debug-mode)).
* `FDP_STALL_S=5`: seconds a gloo collective may wait before the ranks compare, through the
  group's store, what each waits on; ranks waiting on different collectives raise
  `CollectiveError` naming both then, not at the timeout (`0`: off). See
  [errors.md](errors.md#checked-always).
* `FDP_LOG=INFO` (or `DEBUG`): fdp's log lines on stderr as `[fdp rank r] ...`, e.g. each
  Reducer's bucket plan.
* `FDP_KERNELS=torch|triton`: force the flatten/unflatten implementation (default: Triton for
  CUDA tensors when it is installed, stock torch ops otherwise).
* `FDP_MALLOC=os`: the default of `fdp.init(malloc=)`: leave glibc's malloc thresholds alone.
  By default (`keep`) `fdp.init` raises them so freed memory stays in the process for the
  next step instead of being faulted in again (`fdp/_comm/lifetime.py`; docs/performance.md).
"""

# (section title, module, name patterns in order; a pattern ending in '*' takes the rest of
# that module's public names). Every public name must land in exactly one section.
SECTIONS: list[tuple[str, str, list[str]]] = [
    ("Setup", "fdp", ["init", "Group"]),
    ("Models as pure functions", "fdp", ["functionalize", "Apply", "units", "deferred_init", "DeferredInit"]),
    ("Gradients", "fdp", ["Reducer", "Pending", "FusedStep", "CompiledStep", "FusedState", "ShardedParams", "StepMemory",
                          "local_grad", "local_grad_and_value",
                          "StepRecord", "Timeline", "BucketTimes",
                          "BucketPlan", "Bucket"]),
    ("Across ranks", "fdp", ["broadcast", "sync_buffers", "psum", "pmean", "any_rank", "assert_same_shapes",
                             "assert_replicas_equal", "ReplicaCheck"]),
    ("Checkpoints", "fdp", ["save", "load", "save_sharded", "load_sharded", "Shard", "rng_state", "set_rng_state",
                            "RngState", "save_safetensors", "safetensors_params", "SafetensorsParams"]),
    ("Errors", "fdp", ["ReplicaMismatchError", "CollectiveError", "CheckpointError"]),
    ("`fdp.hooks` — communication hooks", "fdp.hooks", ["*"]),
    ("`fdp.optim` — functional optimizers", "fdp.optim", ["*"]),
    ("`fdp.cost` — the step's cost model and tuned bucket caps", "fdp.cost", ["*"]),
    ("`fdp.optim.schedules` — learning-rate schedules", "fdp.optim.schedules", ["*"]),
    ("`fdp.testing` — simulated ranks", "fdp.testing", ["*"]),
    ("`fdp.viz` — pictures", "fdp.viz", ["*"]),
]


# Classes a user never constructs: no constructor signature (their docstrings say where
# instances come from), or, for a callable one, the signature of a call on an instance.
NOT_CONSTRUCTED: dict[str, str | None] = {
    "fdp.Apply": "apply",  # returned by fdp.functionalize; shown as a call
    "fdp.Pending": None,  # returned by Reducer.all_reduce_async
    "fdp.ReplicaCheck": None,  # returned by assert_replicas_equal(wait=False)
    "fdp.BucketPlan": None,  # built with BucketPlan.build
    "fdp.ShardedParams": None,  # returned by a fully sharded step (and FusedStep.shard)
    "fdp.StepMemory": None,  # returned by FusedStep.memory
    "fdp.CompiledStep": None,  # returned by FusedStep.compile
    "fdp.optim.Inspection": None,  # returned by fdp.optim.inspect and FusedStep.inspect
    "fdp.DeferredInit": None,  # returned by fdp.deferred_init
    "fdp.SafetensorsParams": None,  # returned by fdp.safetensors_params
}
WIDTH = 100  # longer signatures get one parameter per line


def public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")
                 and not isinstance(getattr(module, n), types.ModuleType)]
    return [n for n in names if not isinstance(getattr(module, n), types.ModuleType)]


def _signature(name: str, obj: object) -> str | None:
    target = obj
    if name in NOT_CONSTRUCTED:
        if NOT_CONSTRUCTED[name] is None:
            return None
        name, target = NOT_CONSTRUCTED[name], obj.__call__  # type: ignore[attr-defined]
    elif inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return None
        if issubclass(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple: its fields
            return f"{name}({', '.join(obj._fields)})"
        target = obj.__init__ if "__init__" in vars(obj) else obj
    elif not callable(obj):
        return None
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    text = str(sig.replace(parameters=params))
    text = re.sub(r"(: |-> )'([^'\n]*)'", r"\1\2", text)  # string annotations (postponed evaluation)
    text = text.replace("datetime.timedelta(", "timedelta(")
    if inspect.isclass(obj):
        text = re.sub(r" -> None$", "", text)
    if len(name) + len(text) > WIDTH and params:
        # One parameter per line: split the rendered list at the top-level commas.
        inner, depth, parts, cur = text[1:text.rindex(")")], 0, [], ""
        for ch in inner:
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == "," and depth == 0:
                parts.append(cur.strip())
                cur = ""
            else:
                cur += ch
        parts.append(cur.strip())
        text = "(\n" + "".join(f"    {p},\n" for p in parts) + text[text.rindex(")"):]
    return f"{name}{text}"


def _is_value(obj: object) -> bool:
    """A module-level constant (e.g. ``fdp.hooks.allreduce``, a ``CommHook``), not a class or
    function: it is documented by its own ``__doc__``, never its class's."""
    return not (inspect.isclass(obj) or inspect.isroutine(obj))


def _docstring(obj: object) -> str:
    if _is_value(obj):
        doc = vars(obj).get("__doc__") if hasattr(obj, "__dict__") else None
        return _markdown(inspect.cleandoc(doc)) if doc else ""
    return _markdown(inspect.getdoc(obj) or "")


SECTION = re.compile(r"^(Args|Attributes|Raises|Returns|Example|Examples):$")
ENTRY = re.compile(r"^(\*{0,2}[\w.]+(?:, \*{0,2}[\w.]+)*)( \([^)]*\))?: (.*)$")


def _sections(lines: list[str]) -> list[str]:
    """Google-style sections to Markdown: ``Args:``/``Attributes:``/``Raises:`` entries
    (``name: text``, continued on deeper-indented lines) become a bullet list with the names as
    code; ``Returns:`` and ``Example:`` become a bold label followed by their dedented text."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = SECTION.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        kind = m[1]
        i += 1
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i][0] == " "):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        body = textwrap.dedent("\n".join(block)).splitlines()
        out += ["", f"**{kind}:**", ""]
        if kind in ("Args", "Attributes", "Raises"):
            for line in body:
                entry = ENTRY.match(line) if line and line[0] != " " else None
                if entry:
                    names = ", ".join(f"`{n.strip()}`" for n in entry[1].split(","))
                    out.append(f"* {names}{entry[2] or ''}: {entry[3]}")
                elif line.strip():
                    out.append("  " + line.strip() if out[-1].startswith(("*", "  ")) else line)
                else:
                    out.append("")
        else:
            out += body
        out.append("")
    return out


def _markdown(doc: str) -> str:
    """Docstring text to Markdown: Google-style sections as lists, doctest runs as ```pycon,
    ``Example::`` blocks as ```python skip (shown, not run)."""
    out: list[str] = []
    lines = _sections(doc.splitlines())
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith(">>>"):
            indent = len(line) - len(stripped)
            block = []
            while i < len(lines) and lines[i].strip() and (len(lines[i]) - len(lines[i].lstrip())) >= indent:
                block.append(lines[i][indent:])
                i += 1
            out += ["```pycon", *block, "```"]
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            label = line[:-1] if stripped != "::" else ""
            out.append(f"**{label}**" if SECTION.match(label) else label)
            out.append("")
            i += 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            block = []
            indent = None
            while i < len(lines) and (not lines[i].strip() or indent is None
                                      or len(lines[i]) - len(lines[i].lstrip()) >= indent):
                if lines[i].strip() and indent is None:
                    indent = len(lines[i]) - len(lines[i].lstrip())
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["```python skip", *textwrap.dedent("\n".join(block)).splitlines(), "```", ""]
            continue
        out.append(line)
        i += 1
    return "\n".join(out).strip()


def _members(cls: type) -> list[tuple[str, object]]:
    members = []
    for name, value in vars(cls).items():
        if isinstance(value, functools.cached_property):  # documented as a property
            value = property(value.func, doc=value.__doc__)
        if name.startswith("_") or not (inspect.getdoc(value) if not isinstance(value, property) else value.__doc__):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if callable(value) or isinstance(value, property):
            members.append((name, value))
    return members


# Tables kept in a hand-written page and shown in the reference too: (page, "## heading").
PAGE_SECTIONS = {"fdp.optim": (("optim.md", "## From optax"), ("optim.md", "## From torch.optim"))}


def _page_section(page: str, heading: str) -> str:
    """One ``## heading`` section of ``docs/page``, as a ``###`` section with its link."""
    lines = (DOCS / page).read_text().splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = "\n".join(lines[start + 1:end]).strip()
    body = re.sub(r"\]\(#", f"]({page}#", body)  # (its links to its own page's headings, from api.md)
    return f"#{heading} (from [{page}]({page}))\n\n{body}\n"


def render_entry(qualname: str, obj: object) -> str:
    parts = [f"### `{qualname}`", ""]
    sig = _signature(qualname, obj)
    if sig:
        parts += ["```text", sig, "```", ""]
    if _is_value(obj):
        parts += [f"A constant: `{obj!r}`.", ""]
    doc = _docstring(obj)
    if not doc and _is_value(obj):
        raise SystemExit(f"gen_api: {qualname} has no docstring of its own: set {qualname.rsplit('.', 1)[1]}.__doc__")
    if doc:
        parts += [doc, ""]
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        for name, member in _members(obj):
            if isinstance(member, property):
                parts += [f"#### `{qualname}.{name}` (property)", "", _markdown(inspect.cleandoc(member.__doc__)), ""]
            else:
                msig = _signature(f"{qualname}.{name}", member)
                parts += [f"#### `{qualname}.{name}`", ""]
                if msig:
                    parts += ["```text", msig, "```", ""]
                parts += [_markdown(inspect.getdoc(member) or ""), ""]
    return "\n".join(parts)


def sections() -> list[tuple[str, str, list[tuple[str, object]]]]:
    """``(title, module name, [(qualified name, object), ...])`` per section, in page order.

    Raises SystemExit if a section names something fdp does not export, or a public name of
    ``fdp`` lands in no section."""
    import importlib

    import fdp

    placed: set[str] = set()
    out = []
    for title, modname, patterns in SECTIONS:
        module = importlib.import_module(modname)
        names = public_names(module)
        chosen: list[str] = []
        for pat in patterns:
            if pat == "*":
                chosen += [n for n in names if n not in chosen]
            else:
                chosen.append(pat)
        entries = []
        for n in chosen:
            qual = f"{modname}.{n}"
            if n not in names:
                raise SystemExit(f"gen_api: section {title!r} names {qual}, which {modname} does not export")
            placed.add(qual)
            entries.append((qual, getattr(module, n)))
        out.append((title, modname, entries))
    missing = sorted({f"fdp.{n}" for n in public_names(fdp)} - placed)
    if missing:
        raise SystemExit(f"gen_api: public names in no section of docs/gen_api.py: {missing}")
    return out


def documented() -> list[tuple[str, object]]:
    """Everything the page shows a docstring of, as ``(qualified name, object)``: each
    section's submodule (its docstring opens the section), every entry, and for classes the
    public methods and properties. The test suite runs their ``>>>`` examples."""
    import importlib

    found: list[tuple[str, object]] = []
    for _, modname, entries in sections():
        if modname != "fdp" and modname not in dict(found):
            found.append((modname, importlib.import_module(modname)))
        for qual, obj in entries:
            found.append((qual, obj))
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                found += [(f"{qual}.{m}", member) for m, member in _members(obj)]
    return found


def render() -> str:
    import importlib

    body = [INTRO]
    opened: set[str] = set()
    for title, modname, entries in sections():
        body.append(f"---\n\n## {title}\n")
        if modname != "fdp" and modname not in opened:  # a submodule's own docstring opens its section
            opened.add(modname)
            body.append(_markdown(inspect.getdoc(importlib.import_module(modname)) or "") + "\n")
            body += [_page_section(page, heading) for page, heading in PAGE_SECTIONS.get(modname, ())]
        for qual, obj in entries:
            body.append(render_entry(qual, obj))
    body.append("---\n\n" + OUTRO)
    text = "\n".join(body)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


INTERNALS_START = "<!-- torch internals: generated by docs/gen_api.py from fdp/_internals.py's CATALOGUE -->"
INTERNALS_END = "<!-- end of the generated table -->"


def internals_table() -> str:
    """The markdown table of every private torch API fdp uses (``fdp._internals.CATALOGUE``)."""
    from fdp import _internals

    rows = ["| API | fdp's name (`fdp/_internals.py`) | why | checked on torch |", "| --- | --- | --- | --- |"]
    for use in _internals.CATALOGUE:
        rows.append(f"| `{use.api}` | `{use.name}` | {use.why} | {use.checked} |")
    return "\n".join(rows)


def architecture() -> str:
    """docs/architecture.md with its table of torch internals generated anew."""
    text = (DOCS / "architecture.md").read_text()
    start, end = text.index(INTERNALS_START), text.index(INTERNALS_END)
    return text[:start + len(INTERNALS_START)] + "\n" + internals_table() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    outputs = {DOCS / "api.md": render(), DOCS / "architecture.md": architecture()}
    if "--check" in argv:
        stale = [p.name for p, text in outputs.items() if p.read_text() != text]
        if stale:
            print(f"{', '.join(stale)} stale: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(DOCS.parent))
    sys.exit(main(sys.argv[1:]))
