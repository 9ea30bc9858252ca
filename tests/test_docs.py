"""The documentation is code: its Python blocks and docstring examples run, and docs/api.md is
generated from the docstrings.

Each Markdown file's ```python blocks run in order in one shared namespace, from a temporary
folder: once in a world of one (no torchrun environment), and once on 2 ranks started as
torchrun starts them (forked processes with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... set
and no process group yet, each from its own RNG seed), as the docs say the same code runs
under torchrun. Blocks marked ```python ranks=2 (DDP's own code, which needs a process group)
run only in the 2-rank run. Blocks whose info string is anything else (```bash, ```text,
```python skip, ...) are shown but not run. docs/api.md's ``>>>`` examples are the
docstrings' doctests (below).
"""

from __future__ import annotations

import doctest
import functools
import importlib.util
import multiprocessing as mp
import os
import re
import socket
import sys
import traceback
import types
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fdp
import fdp.viz

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Every page's ```python blocks run; docs/measurements.md is a record of commands and their
# figures (its one script is marked skip: a torchrun probe), so it has none to run.
RECORDS = {"measurements.md"}
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUNNABLE = [p for p in MARKDOWN if p.name not in RECORDS]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "TORCHELASTIC_RUN_ID")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)\s*(?P<info>.*?)\s*$")


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """``(info string, first line number, code)`` of every fenced block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"], i + 1
        body, i = [], i + 1
        while i < len(lines):
            end = FENCE.match(lines[i])
            if end and end["fence"].startswith(fence) and not end["info"]:
                break
            body.append(lines[i])
            i += 1
        else:
            raise AssertionError(f"unclosed code fence opened on line {start}")
        blocks.append((info, start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def test_code_block_parser_splits_blocks_and_keeps_line_numbers():
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python skip\nb = 2\n```\n"
    assert code_blocks(text) == [("python", 3, "a = 1\n"), ("bash", 6, "ls\n"), ("python skip", 9, "b = 2\n")]


RUN_ON = {"python": (1, 2), "python ranks=2": (2,)}  # info string -> the world sizes that run it


def run_blocks(path: Path, world_size: int = 1) -> int:
    """Run the file's ```python blocks for this world size in order, in one namespace;
    return how many ran."""
    # A module of its own, in sys.modules while the blocks run, as a user's script is: dynamo
    # imports a function's module by name when it inlines it into a frame of another module
    # (a loss defined in the doc, called from fdp's compiled step).
    module = types.ModuleType(f"doc:{path.name}")
    namespace: dict = module.__dict__
    sys.modules[module.__name__] = module
    ran = 0
    try:
        for info, line, code in code_blocks(path.read_text()):
            if world_size not in RUN_ON.get(info, ()):
                continue
            # Pad with newlines so tracebacks show the Markdown file's own line numbers.
            compiled = compile("\n" * (line - 1) + code, str(path), "exec")
            try:
                exec(compiled, namespace)
            except Exception as e:
                raise AssertionError(f"{path.relative_to(ROOT)}: the python block starting on line {line} "
                                     f"raised {type(e).__name__}: {e}") from e
            ran += 1
    finally:
        sys.modules.pop(module.__name__, None)
    return ran


def skip_compile_doc_where_dynamo_cannot_trace_fdp(path: Path) -> None:
    """docs/compile.md compiles a step: on a torch whose dynamo cannot trace fdp (the probe
    of tests/test_compile.py; docs/compile.md's table) it cannot run. (torch 2.4's dynamo
    also fails earlier there, tokenizing the Markdown file as Python source.)"""
    if path.name == "compile.md":
        from compiling import skip_unless_dynamo_traces_fdp

        skip_unless_dynamo_traces_fdp()  # (and the compilers imported here, before the forks)


def doc_params(paths: list[Path], *compile_marks: pytest.MarkDecorator) -> list:
    """One param per file; docs/compile.md's blocks compile a step: marked ``compile`` (and
    ``compile_marks``)."""
    return [pytest.param(p, id=p.name, marks=[pytest.mark.compile, *compile_marks] if p.name == "compile.md" else [])
            for p in paths]


@pytest.mark.parametrize("path", doc_params(RUNNABLE, pytest.mark.slow))  # (compile.md: a dynamo trace)
def test_python_blocks_run_in_a_world_of_one(path, tmp_path, monkeypatch):
    """Every ```python block of the file runs without raising (blocks in order, one namespace)."""
    assert path.exists(), f"{path} is missing"
    skip_compile_doc_where_dynamo_cannot_trace_fdp(path)
    for var in TORCHRUN_ENV:
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized(), "a previous test left torch.distributed initialised"
    monkeypatch.chdir(tmp_path)  # files the examples write land here
    assert in_fork(run_blocks, path) > 0, f"{path.name} has no ```python block: was a fence mistyped?"


def in_fork(fn, *args, timeout: float = 300):
    """``fn(*args)`` in a forked child, its exception re-raised here as an AssertionError.

    A doc may compile (docs/compile.md does): compiling in the pytest process would start
    autograd's worker threads, and on CUDA builds of torch every later fork-based test would
    then fail (see tests/test_compile.py)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send(("ok", fn(*args)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            send.send(("err", f"{e}\n{traceback.format_exc()}"))
        finally:
            os._exit(0)

    # (not daemonic: a block may start processes itself, as fdp.testing's gloo ranks; it is
    # killed below when it outlives the timeout)
    proc = ctx.Process(target=child, daemon=False)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise AssertionError(f"{fn.__name__}{args} did not finish within {timeout}s")
        kind, value = recv.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    if kind == "err":
        raise AssertionError(value)
    return value


def as_torchrun(fn, world_size: int, *args, timeout: float = 240) -> list:
    """``fn(*args)`` in ``world_size`` forked processes started as torchrun starts its workers:
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set, no process
    group yet (the code under test makes it: ``fdp.init()``, ``dist.init_process_group``),
    and a different RNG seed per rank (torchrun's workers seed themselves apart; fixed here,
    so a failure reproduces). Returns the results in rank order; the first rank's error is
    raised as an AssertionError, and ranks still waiting for it are killed."""
    with socket.socket() as s:  # a free port for the rendezvous (MASTER_PORT)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    procs, pipes = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)

        def child(rank=rank, send=send):
            try:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                                  LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
                torch.manual_seed(1000 + rank)
                send.send(("ok", fn(*args)))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                send.send(("err", f"rank {rank}: {e}\n{traceback.format_exc()}"))
            finally:
                os._exit(0)

        procs.append(ctx.Process(target=child, daemon=False))  # (as in in_fork)
        procs[-1].start()
        send.close()
        pipes.append(recv)
    results: dict[int, tuple] = {}
    try:
        pending = dict(enumerate(pipes))
        while pending:
            ready = wait(list(pending.values()), timeout=timeout)
            if not ready:
                raise AssertionError(f"ranks {sorted(pending)} did not finish within {timeout}s")
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    results[rank] = pending.pop(rank).recv()
                except EOFError:
                    results[rank] = ("err", f"rank {rank} died without a result")
                if results[rank][0] == "err":
                    timeout = min(timeout, 10)  # the others may be stuck in a collective with it
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    errors = [results[r][1] for r in sorted(results) if results[r][0] == "err"]
    if errors:
        raise AssertionError(errors[0])
    return [results[r][1] for r in range(world_size)]


def _blocks_on_rank(path: Path, folder: str) -> int:
    os.chdir(folder)  # one folder for both ranks, as a shared file system (fdp.save/load)
    return run_blocks(path, world_size=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", doc_params(RUNNABLE, pytest.mark.slow))  # (compile.md: a dynamo trace on both ranks)
def test_python_blocks_run_on_two_ranks_as_under_torchrun(path, tmp_path):
    """The same blocks (and the ```python ranks=2 ones), on 2 ranks launched as torchrun
    launches them: what a user gets from the docs under ``torchrun --nproc-per-node 2``."""
    skip_compile_doc_where_dynamo_cannot_trace_fdp(path)
    assert not dist.is_initialized(), "a previous test left torch.distributed initialised"
    ran = as_torchrun(_blocks_on_rank, 2, path, str(tmp_path))
    assert ran[0] == ran[1] > 0


def public_names() -> list[str]:
    """Every public name a user can reach: ``fdp.__all__`` and the ``__all__`` of its
    public submodules (the modules in ``fdp.__all__``, plus ``fdp.viz``)."""
    names = [f"fdp.{n}" for n in fdp.__all__]
    modules = [getattr(fdp, n) for n in fdp.__all__ if isinstance(getattr(fdp, n), types.ModuleType)]
    modules.append(fdp.viz)
    for mod in modules:
        public = getattr(mod, "__all__", None)
        if public is None:
            public = [n for n in vars(mod) if not n.startswith("_")
                      and not isinstance(getattr(mod, n), types.ModuleType)]
        names += [f"{mod.__name__}.{n}" for n in public]
    return names


def _gen_api() -> types.ModuleType:
    """docs/gen_api.py, imported by path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What docs/api.md shows a docstring of: the sections' submodules, every public name, and the
# public methods and properties of classes, as (qualified name, object).
DOCUMENTED = _gen_api().documented()
DOCTEST_GLOBALS = {"fdp": fdp, "torch": torch, "nn": torch.nn, "F": torch.nn.functional}


def test_api_md_is_generated_from_the_docstrings():
    """docs/api.md is what docs/gen_api.py renders from the code (the generator itself refuses a
    public name of fdp that lands in no section)."""
    expected = _gen_api().render()
    assert (DOCS / "api.md").read_text() == expected, (
        "docs/api.md is stale: it differs from what the docstrings generate; run "
        "`python docs/gen_api.py` and commit docs/api.md (edit the docstrings, not api.md)"
    )


def test_the_table_of_torch_internals_is_generated_from_the_catalogue():
    """docs/architecture.md's table of private torch APIs is fdp._internals.CATALOGUE's."""
    assert (DOCS / "architecture.md").read_text() == _gen_api().architecture(), (
        "docs/architecture.md's table of torch internals is stale: run `python docs/gen_api.py`")


def test_api_md_covers_every_public_name():
    """Also the names of the public submodules (fdp.hooks, fdp.optim, fdp.testing, fdp.viz)."""
    documented = dict(DOCUMENTED)
    missing = [n for n in public_names() if n not in documented and not isinstance(
        functools.reduce(getattr, n.split(".")[1:], fdp), types.ModuleType)]
    assert not missing, f"public names that docs/gen_api.py's SECTIONS do not reach: {missing}"


def test_every_documented_name_has_a_docstring():
    missing = [q for q, obj in DOCUMENTED if not (obj.__doc__ or "").strip()]
    assert not missing, f"public names without a docstring (api.md is built from them): {missing}"


def _doctest_failures(qualname: str, obj: object) -> str:
    """Run the ``>>>`` examples of ``obj``'s own docstring; the failure report ("" if none)."""
    doc = obj.__doc__ if isinstance(obj, property) else None
    tests = doctest.DocTestFinder(recurse=False).find(
        doc if doc is not None else obj, qualname, module=False, globs=dict(DOCTEST_GLOBALS))
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    return "".join(report)


def _every_doctest(folder: str) -> dict[str, str]:
    """Each documented name's doctest report, run one after another in this process, each from
    the seed the tests start from (tests/conftest.py) and in a folder of its own."""
    reports = {}
    for i, (qualname, obj) in enumerate(DOCUMENTED):
        os.makedirs(os.path.join(folder, str(i)))
        os.chdir(os.path.join(folder, str(i)))
        torch.manual_seed(0)
        reports[qualname] = _doctest_failures(qualname, obj)
    return reports


@pytest.fixture(scope="module")
def doctest_reports(tmp_path_factory) -> dict[str, str]:
    """Every name's doctests, run in one forked child (a fork per name costs more than the
    examples): in a world of one, from a temporary folder."""
    with pytest.MonkeyPatch.context() as mp:
        for var in TORCHRUN_ENV:
            mp.delenv(var, raising=False)
        return in_fork(_every_doctest, str(tmp_path_factory.mktemp("doctests")))


@pytest.mark.parametrize("qualname", [q for q, _ in DOCUMENTED])
def test_docstring_examples_run(qualname, doctest_reports):
    """The name's ``>>>`` examples are doctests: they run in a world of one and print what they
    show (``fdp``, ``torch``, ``nn`` and ``F`` imported; files land in a temporary folder). In a
    forked child, like the Markdown blocks (see ``in_fork``)."""
    report = doctest_reports[qualname]
    if report:
        pytest.fail(f"the docstring examples of {qualname} fail:\n{report}", pytrace=False)


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_into_api_md_name_headings_that_exist():
    """api.md's headings are generated: a link to an anchor of it must still find one."""
    anchors = {_github_anchor(line) for line in (DOCS / "api.md").read_text().splitlines()
               if line.startswith("#")}
    broken = [f"{path.relative_to(ROOT)}: api.md#{anchor}" for path in MARKDOWN
              for anchor in re.findall(r"api\.md#([\w\-]+)", path.read_text()) if anchor not in anchors]
    assert not broken, f"links to headings docs/api.md no longer has: {broken}"


def test_links_between_the_docs_name_headings_that_exist():
    """Every ``[..](page.md#anchor)`` and ``[..](#anchor)`` in the README and docs/ finds a
    heading of that page (as GitHub makes its anchors)."""
    pages = {path: {_github_anchor(line) for line in path.read_text().splitlines() if line.startswith("#")}
             for path in MARKDOWN}
    by_name = {path.name: anchors for path, anchors in pages.items()}
    broken = []
    for path in MARKDOWN:
        for page, anchor in re.findall(r"\]\((?:docs/)?([\w\-]+\.md)?#([\w\-]+)\)", path.read_text()):
            anchors = by_name.get(page) if page else pages[path]
            if anchors is not None and anchor not in anchors:
                broken.append(f"{path.relative_to(ROOT)}: {page}#{anchor}")
    assert not broken, f"links to headings that do not exist: {broken}"


def test_shell_commands_name_the_venvs_python_and_torchrun():
    """```bash blocks call ``.venv/bin/python`` and ``.venv/bin/torchrun`` (what ``make``
    installs, as the README's commands do) or another venv's ``bin/``, never a bare
    ``python`` or ``torchrun``, which runs whatever install comes first on PATH."""
    bare = re.compile(r"(?<![\w/.-])(python|torchrun)(?=\s)")
    found = [f"{path.relative_to(ROOT)}:{line + i}: {text.strip()}"
             for path in MARKDOWN for info, line, code in code_blocks(path.read_text()) if info == "bash"
             for i, text in enumerate(code.splitlines()) if bare.search(text)]
    assert not found, f"bare python/torchrun in shell commands: {found}"
