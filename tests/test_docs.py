"""The documentation is tested like code, so that it cannot drift from what it describes: links and
anchors resolve, shown Python parses and names only what exists, complete scripts are examples that
run, the config reference matches the schema, and the command line's help is plain text.

All of it runs in this process: the one script it runs (the README's quick example) trains a tiny
model for three steps as a world of one."""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import re
import runpy
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    """The guide and every package's own page: what a reader follows links through."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "conformance" / "README.md"]
    files += sorted((ROOT / "backends").glob("*/README.md"))
    files += sorted((ROOT / "examples").rglob("README.md"))
    return files


def guide_files() -> list[Path]:
    """The pages this repository's guide owns: their complete scripts must be examples that run."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- Markdown, as much of it as the docs use ------------------------------------------------------

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")


@dataclasses.dataclass
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    marker: str | None  # the `<!-- from PATH -->` comment right above it, if any


def split_markdown(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """The prose lines (numbered) and the fenced code blocks of a Markdown page."""
    prose, blocks = [], []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        above = [ln for _, ln in prose if ln.strip()]
        marker = re.fullmatch(r"\s*<!--\s*from\s+(\S+)\s*-->\s*", above[-1]) if above else None
        blocks.append(Block(lang, "\n".join(body) + "\n", start + 1, marker.group(1) if marker else None))
    return prose, blocks


def _without_code_spans(line: str) -> str:
    return re.sub(r"(`+)(.+?)\1", "", line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, punctuation dropped, each
    space a hyphen (github-slugger)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_markdown(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
        out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return out


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    prose, _ = split_markdown(path.read_text())
    return [(n, target) for n, line in prose for target in _LINK.findall(_without_code_spans(line))]


# -- links ----------------------------------------------------------------------------------------


def test_every_relative_link_and_anchor_resolves():
    problems = []
    cache: dict[Path, set[str]] = {}
    for page in doc_files():
        for line, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not ours to check
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{_rel(page)}:{line}: {target}"
            if ROOT not in dest.parents and dest != ROOT:
                problems.append(f"{where}: leads outside the repository")
            elif not dest.exists():
                problems.append(f"{where}: {path_part} does not exist")
            elif anchor:
                if dest.suffix != ".md":
                    problems.append(f"{where}: an anchor into a file that is not Markdown")
                    continue
                found = cache.setdefault(dest, anchors(dest))
                if anchor not in found:
                    problems.append(f"{where}: no heading makes #{anchor} in {_rel(dest)}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_are_githubs():
    assert github_slug("XLA:CPU at -O0 in the tests") == "xlacpu-at--o0-in-the-tests"
    assert github_slug("`cpu_ram_efficient_loading: true`") == "cpu_ram_efficient_loading-true"
    assert github_slug("Plan: will it fit?") == "plan-will-it-fit"
    assert github_slug("The bound: `GRADIENT_ROUNDING`") == "the-bound-gradient_rounding"
    assert github_slug("[conformance](x.md) suite") == "conformance-suite"


def test_the_link_check_sees_a_broken_link(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](#top) [bad](#nowhere) `[not a link](#nowhere)`\n\n```\n[nor](#this)\n```\n")
    assert links(page) == [(3, "#top"), (3, "#nowhere")]
    assert anchors(page) == {"top"}


# -- Python shown in the docs ---------------------------------------------------------------------


def python_blocks(pages: list[Path]) -> list[tuple[Path, Block]]:
    return [(p, b) for p in pages for b in split_markdown(p.read_text())[1] if b.lang in ("python", "py")]


def free_names(tree: ast.AST) -> set[str]:
    """Names the code reads but never binds, builtins aside: a block with none is a complete script."""
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def _shardcore_references(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names) for every `from shardcore... import names` and `shardcore.name` in the code."""
    refs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0].startswith("shardcore"):
            refs.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            refs += [(a.name, []) for a in node.names if a.name.split(".")[0].startswith("shardcore")]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("shardcore", "shardcore_conformance")
        ):
            refs.append((node.value.id, [node.attr]))
    return refs


def test_every_python_block_parses_and_names_what_exists():
    """A fragment cannot run, but it can still rot: it must parse, and whatever it takes from
    shardcore (``shardcore.save``, ``from shardcore_conformance import run_suite``) must exist."""
    problems = []
    for page, block in python_blocks(doc_files()):
        where = f"{_rel(page)}:{block.line}"
        try:
            tree = ast.parse(textwrap.dedent(block.text))
        except SyntaxError as e:
            problems.append(f"{where}: does not parse ({e.msg}, line {e.lineno} of the block)")
            continue
        for module, names in _shardcore_references(tree):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                problems.append(f"{where}: import {module} fails ({e})")
                continue
            problems += [f"{where}: {module} has no {n}" for n in names if not hasattr(mod, n)]
    assert not problems, "\n".join(problems)


def _examples() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted((ROOT / "examples").rglob("*.py"))}


def _run_by_a_test(example: Path) -> bool:
    """Whether some test names the example's file: it is run there (this file runs quickstart.py,
    tests/test_loop.py runs demo.py)."""
    return any(example.name in t.read_text() for t in (ROOT / "tests").glob("test_*.py"))


def test_complete_scripts_are_examples_that_run_and_excerpts_match_them():
    """A complete script in the guide is a file under examples/ shown verbatim, which a test runs;
    an excerpt marked ``<!-- from examples/x.py -->`` is still, verbatim, in that file."""
    examples = _examples()
    problems = []
    for page, block in python_blocks(guide_files()):
        where = f"{_rel(page)}:{block.line}"
        if block.marker:
            source = (ROOT / block.marker).resolve()
            if source not in examples:
                problems.append(f"{where}: marked as from {block.marker}, which is no Python file under examples/")
            elif block.text not in examples[source]:
                problems.append(f"{where}: no longer what {block.marker} holds; copy it again from the file")
            elif not _run_by_a_test(source):
                problems.append(f"{where}: {block.marker} is run by no test")
            continue
        if free_names(ast.parse(textwrap.dedent(block.text))):
            continue  # a fragment: it needs names the page describes (a model, a loader)
        sources = [p for p, text in examples.items() if text == block.text]
        if not sources:
            problems.append(f"{where}: a complete script that is not a file under examples/: put it there and run it")
        elif not any(_run_by_a_test(p) for p in sources):
            problems.append(f"{where}: {_rel(sources[0])} is run by no test")
    assert not problems, "\n".join(problems)


def test_the_quick_example_trains():
    """The README's first code block is examples/quickstart.py; it runs here as a world of one."""
    example = ROOT / "examples" / "quickstart.py"
    _, blocks = split_markdown((ROOT / "README.md").read_text())
    assert blocks[0].text == example.read_text(), "README's quick example is no longer examples/quickstart.py"
    import torch

    out = io.StringIO()
    with torch.random.fork_rng(), contextlib.redirect_stdout(out):
        runpy.run_path(str(example), run_name="__main__")
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", out.getvalue(), re.M)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), out.getvalue()


# -- the config reference against the schema ------------------------------------------------------


def _table(page: Path, heading: str) -> list[list[str]]:
    """The cells of the first table under ``heading`` (its header row and separator left out)."""
    text = page.read_text()
    start = text.index(f"\n{heading}\n")
    rows = []
    for line in text[start:].split("\n")[2:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif rows:
            break
    return [r for r in rows[2:]]


def _spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _in_tree_backends() -> dict[str, frozenset[str] | None]:
    """Each in-tree backend's supported keys; None where its package is not installed here (the
    newest-torch environment has no XLA backend)."""
    out = {}
    for name, spec in {"fsdp2": "shardcore_fsdp2:FSDP2Backend", "xla": "shardcore_xla:XLABackend"}.items():
        module, _, cls = spec.partition(":")
        out[name] = (
            frozenset(getattr(importlib.import_module(module), cls).supported_keys)
            if importlib.util.find_spec(module)
            else None
        )
    return out


CONFIG_DOC = ROOT / "docs" / "config.md"


def test_config_reference_matches_the_schema():
    from shardcore.config import schema

    rows = {_spans(r[0])[0]: r for r in _table(CONFIG_DOC, "## Keys")}
    fields = {f.name: f for f in dataclasses.fields(schema.ShardConfig) if f.name != "explicit"}
    assert sorted(set(fields) - set(rows)) == [], "keys of ShardConfig missing from docs/config.md"
    assert sorted(set(rows) - set(fields)) == [], "keys in docs/config.md that ShardConfig no longer has"
    backends = _in_tree_backends()
    sources = (ROOT / "shardcore" / "config" / "sources.py").read_text() + (
        ROOT / "shardcore/config/schema.py"
    ).read_text()
    problems = []
    for name, f in fields.items():
        key, typ, default, honoured, also, _meaning = rows[name]
        if _spans(typ)[:1] != [f.type]:
            problems.append(f"{name}: type is {f.type}, the docs say {typ}")
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, dict) else value
        if _spans(default)[:1] != [json.dumps(value)]:
            problems.append(f"{name}: default is {json.dumps(value)}, the docs say {default}")
        if name in ("version", "backend"):  # not settings a backend honours: they choose one
            if not honoured.startswith("all"):
                problems.append(f"{name}: every backend reads it; the docs say {honoured}")
        else:
            for backend, keys in backends.items():
                if keys is not None and (name in keys) != (backend in _spans(honoured)):
                    problems.append(f"{name}: {backend} {'honours' if name in keys else 'refuses'} it")
        for spelling in _spans(also):
            word = re.match(r"[a-z_][a-z0-9_]*", spelling)
            if word and f'"{word.group()}"' not in sources and f"'{word.group()}'" not in sources:
                problems.append(f"{name}: the docs name {spelling!r} as a source, which config/ never reads")
    assert not problems, "docs/config.md differs from the schema:\n" + "\n".join(problems)


def test_config_reference_lists_the_aliases_and_fsdp1_keys():
    from shardcore.config import schema

    aliases = {_spans(a)[0]: _spans(k)[0] for a, k in _table(CONFIG_DOC, "## Other spellings")}
    assert aliases == {a: k for a, k in schema.KEY_ALIASES.items() if a != k}
    fsdp1 = {_spans(r[0])[0] for r in _table(CONFIG_DOC, "## FSDP1 keys")}
    assert fsdp1 == set(schema.FSDP1_ONLY_KEYS)


# -- the command line's help ----------------------------------------------------------------------

_MARKUP = re.compile(r"`|:(?:func|class|mod|meth|attr|ref|data|exc):")


def _help(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["plan", "--help"], ["backends", "--help"], ["conformance", "--help"]],
    ids=["shardcore", "plan", "backends", "conformance"],
)
def test_help_is_plain_text(argv, capsys):
    """Help is read in a terminal: reST or Markdown markup shows there as stray backticks and roles."""
    from shardcore.cli import main

    text = _help(main, argv, capsys)
    assert text.startswith("usage:")
    assert not _MARKUP.search(text), f"markup in `shardcore {' '.join(argv)}`:\n{text}"


def test_conformance_help_is_plain_text(capsys):
    from shardcore_conformance.cli import main

    text = _help(main, ["--help"], capsys)
    assert "--backend" in text
    assert not _MARKUP.search(text), f"markup in `shardcore-conformance --help`:\n{text}"
