"""Every code block of README.md and docs/ runs, so no recipe drifts from the code.

Each page is one test: its blocks run in order in one namespace (as a reader follows
the page), with the working directory and ``HOME`` set to a fresh temporary folder, so
a page makes its own small data (``mmcache.synth``, ``train_tokenizer``, the local S3
server of moto) and ``~/.cache/mmcache`` lands there. Blocks are found
and run by Sybil:

- ``python`` blocks are executed; ``json`` blocks (a manifest line) must parse;
- ``bash`` blocks whose lines are all ``mmcache ...`` commands run through
  :func:`mmcache.cli.main` in this process and must exit 0;
- a block that cannot run here (a GPU, ``torchrun`` across machines, ``make``) is
  preceded by ``<!-- skip: next "the reason" -->``: the reason is required and the
  skip is reported, so the few such blocks stay visible.

Any other fenced block with a language (``bash`` lines that are not ``mmcache``
commands included) fails the test unless it is skipped with a reason; ``text`` blocks
(diagrams, printed output) are not code. A block without a language fails too.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import unittest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sybil = pytest.importorskip("sybil")
from sybil import Document, Example  # noqa: E402
from sybil.parsers.markdown import (  # noqa: E402
    ClearNamespaceParser,
    CodeBlockParser,
    PythonCodeBlockParser,
    SkipParser,
)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKIP = re.compile(r"<!--\s*skip:\s*(\w+)(.*?)-->", re.DOTALL)
RUN_LANGUAGES = {"python", "bash", "json"}
TEXT_LANGUAGES = {"text"}  # shown, not run: diagrams and printed output


def run_cli_block(example: Example) -> None:
    """Run each ``mmcache ...`` line of a bash block through the CLI's ``main``."""
    from mmcache.cli import main

    for line in str(example.parsed).splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] != "mmcache":
            raise AssertionError(
                f"{example.path}:{example.line}: a bash block runs only `mmcache` commands "
                f'(mark it <!-- skip: next "reason" --> otherwise), got {line!r}'
            )
        code = main(words[1:])
        assert code == 0, f"{example.path}:{example.line}: {line!r} exited {code}"


def check_json_block(example: Example) -> None:
    """A ``json`` block (a manifest line, a record) must parse: each line, or the whole."""
    text = str(example.parsed)
    try:
        json.loads(text)
    except json.JSONDecodeError:
        for line in text.splitlines():
            if line.strip():
                json.loads(line)


PARSERS = [
    PythonCodeBlockParser(),
    CodeBlockParser(language="bash", evaluator=run_cli_block),
    CodeBlockParser(language="json", evaluator=check_json_block),
    SkipParser(),
    ClearNamespaceParser(),
]


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@contextlib.contextmanager
def _memory_tiers_removed(base: Path) -> Iterator[None]:
    """Remove the shared-memory stores of every cache root a page made under ``base``."""
    try:
        yield
    finally:
        from mmcache.cacheroot import memory_name
        from mmcache.stores.memory import store_dir

        names = {memory_name(Path(d).absolute()) for d, _dirs, _files in os.walk(base)}
        for directory in {store_dir(), store_dir(os.getegid())}:
            for name in names:
                for path in glob.glob(f"{directory}/mmcache-{name}*"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)


def test_every_page_is_collected() -> None:
    """README.md and the docs pages are all found (a moved folder fails here)."""
    names = {_page_id(p) for p in PAGES}
    assert "README.md" in names
    assert "docs/index.md" in names
    assert any(n.startswith("docs/recipes/") for n in names)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_skip_names_its_reason(page: Path) -> None:
    for match in SKIP.finditer(page.read_text(encoding="utf-8")):
        action, reason = match.group(1), match.group(2).strip()
        if action == "next":
            assert reason.startswith('"') and len(reason) > 4, (
                f"{_page_id(page)}: {match.group(0)!r}: say why the block cannot run"
            )


def _fence_languages(text: str) -> Iterator[tuple[int, str]]:
    """(line, language) of each opening code fence (``""`` when it names none)."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped.startswith("```"):
            continue
        if not inside:
            yield number, stripped[3:].strip()
        inside = not inside


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_fenced_language_is_run(page: Path) -> None:
    """A block in another language (or none) would silently never run: name it."""
    for line, language in _fence_languages(page.read_text(encoding="utf-8")):
        assert language in RUN_LANGUAGES | TEXT_LANGUAGES, (
            f"{_page_id(page)}:{line}: a ```{language} block is never run; use python, bash "
            "or json (or text for what is not code)"
        )


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_code_blocks_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    document = Document.parse(str(page), *PARSERS)
    skipped: list[str] = []
    with _memory_tiers_removed(tmp_path):
        try:
            for example in document:
                try:
                    example.evaluate()
                except unittest.SkipTest as exc:
                    skipped.append(f"line {example.line}: {exc}")
                    continue
                except Exception as exc:
                    raise AssertionError(
                        f"{_page_id(page)}:{example.line}: the block failed: {exc!r}"
                    ) from exc
        finally:
            _close_everything(document.namespace)
    if skipped:
        with capsys.disabled():
            for line in skipped:
                print(f"\n{_page_id(page)}: skipped {line}")


def _close_everything(namespace: dict[str, Any]) -> None:
    """Close the loaders and caches a page left open (a page need not close them)."""
    from mmcache import Cache, DataLoader

    for value in list(namespace.values()):
        if isinstance(value, DataLoader):
            value.close()
    for value in list(namespace.values()):
        if isinstance(value, Cache):
            value.close()
