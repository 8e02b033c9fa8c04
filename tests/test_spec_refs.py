"""Every GEARBX section cited in the repository (``§3.4``) has a heading in docs/SPEC.md.

The code cites the specification by section number; docs/SPEC.md is where a
reader looks them up. This scans every tracked text file (``git ls-files``),
so it keeps working when files move. Standard library and pytest only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "SPEC.md"

#: Suffixes of the tracked files that are scanned for citations.
TEXT_SUFFIXES = frozenset(
    {".py", ".md", ".c", ".h", ".inc", ".cuh", ".sh", ".json", ".txt", ".toml",
     ".cu", ".metal", ".rst", ".cfg", ".yml", ".yaml"}
)

_NUM = r"\d+(?:\.\d+)*"
#: A section sign, literal or as the JSON escape ``\u00a7`` (json.dumps writes that).
_SIGN = r"(?:§|\\u00[aA]7)"
#: ``§3.4``, ``§ 3.4``, ``§3-4`` / ``§3.2–3.4`` (a range, no spaces around the
#: dash), and ``§§3.2, 3.4 and 5`` (a list, only after a double sign).
CITATION = re.compile(
    rf"(?P<double>{_SIGN}{_SIGN})[ \u00a0]?(?P<list>{_NUM}(?:\s*(?:,|&|and|[-–—])\s*{_NUM})*)"
    rf"|{_SIGN}[ \u00a0]?(?P<one>{_NUM}(?:[-–—]{_NUM})?)"
)
_RANGE = re.compile(rf"({_NUM})\s*[-–—]\s*({_NUM})")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}#")


def _expand_range(start: str, end: str) -> List[str]:
    """``3.2``..``3.4`` -> 3.2, 3.3, 3.4; ``3.2``..``4`` reads as 3.2..3.4."""
    a, b = start.split("."), end.split(".")
    if len(b) < len(a):
        b = a[: len(a) - len(b)] + b
    if len(a) == len(b) and a[:-1] == b[:-1] and 0 <= int(b[-1]) - int(a[-1]) <= 20:
        prefix = ".".join(a[:-1])
        return [f"{prefix}.{i}" if prefix else str(i) for i in range(int(a[-1]), int(b[-1]) + 1)]
    return [start, ".".join(b)]


def _sections(match: re.Match) -> List[str]:
    """Section numbers one citation names."""
    text = match.group("list") if match.group("double") else match.group("one")
    out: List[str] = []
    pos = 0
    for r in _RANGE.finditer(text):
        out.extend(re.findall(_NUM, text[pos : r.start()]))
        out.extend(_expand_range(r.group(1), r.group(2)))
        pos = r.end()
    out.extend(re.findall(_NUM, text[pos:]))
    return out


def citations(text: str) -> Iterator[Tuple[int, str]]:
    """``(line number, section)`` for every section cited in ``text``."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if "§" not in line and "\\u00" not in line:
            continue
        for m in CITATION.finditer(line):
            for section in _sections(m):
                yield lineno, section


def spec_headings(spec_text: str) -> Set[str]:
    """Sections that have a heading: Markdown ``#`` lines outside code fences.

    A heading ``§3.2`` resolves ``§3.2`` only; ``§3`` needs its own heading.
    """
    found: Set[str] = set()
    in_fence = False
    for line in spec_text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and _HEADING.match(line):
            found.update(section for _, section in citations(line))
    return found


def unresolved(files: Iterable[Path], root: Path, headings: Set[str]) -> Tuple[List[str], int]:
    """``file:line §X`` for each citation of ``files`` with no heading, and the citation count."""
    bad: List[str] = []
    count = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        try:
            name = path.relative_to(root).as_posix()
        except ValueError:
            name = str(path)
        for lineno, section in citations(text):
            count += 1
            if section not in headings:
                bad.append(f"{name}:{lineno} §{section}")
    return bad, count


def tracked_text_files(root: Path) -> List[Path]:
    """Tracked files of the checkout with a text suffix (skips the test without git)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed: cannot list the repository's tracked files")
    proc = subprocess.run(
        [git, "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=30
    )
    if proc.returncode != 0:
        reason = proc.stderr.decode(errors="replace").strip().splitlines()
        pytest.skip(f"not a git checkout ({reason[0] if reason else 'git ls-files failed'})")
    names = [n for n in proc.stdout.decode("utf-8", errors="replace").split("\0") if n]
    paths = (root / n for n in names if Path(n).suffix.lower() in TEXT_SUFFIXES)
    return [p for p in paths if p.is_file()]


def test_every_citation_resolves_to_a_spec_heading():
    # This file is left out: its examples cite missing sections on purpose.
    this = Path(__file__).resolve()
    files = [f for f in tracked_text_files(ROOT) if f.resolve() != this]
    assert SPEC.is_file(), "docs/SPEC.md is missing: the § citations have nothing to resolve to"
    headings = spec_headings(SPEC.read_text(encoding="utf-8"))
    bad, count = unresolved(files, ROOT, headings)
    assert count > 0, "no § citation found at all: is the scanner broken?"
    assert not bad, (
        f"{len(bad)} § citation(s) with no heading in docs/SPEC.md "
        "(add a '## §N ...' heading there, or fix the citation):\n" + "\n".join(bad)
    )


def test_a_planted_bad_citation_is_reported(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Rolling window (§3.2)."""\nX = 1  # see §99.9\n', encoding="utf-8")
    headings = spec_headings(SPEC.read_text(encoding="utf-8"))
    bad, count = unresolved([planted], tmp_path, headings)
    assert count == 2
    assert bad == ["planted.py:2 §99.9"]


@pytest.mark.parametrize(
    "text, sections",
    [
        ("scaled (§3.4).", ["3.4"]),
        ("GEARBX § 13.3: compounds", ["13.3"]),
        ("(§5.1, Table 4) and §16.2.", ["5.1", "16.2"]),
        ("see §3-4", ["3", "4"]),
        ("see §3.2–3.4", ["3.2", "3.3", "3.4"]),
        ("see §§3.2, 3.5 and 6", ["3.2", "3.5", "6"]),
        ('"\\u00a79 with MLX affine formats"', ["9"]),
        ("§9 - a cost model", ["9"]),
        ("no citation: 3.4, section sign alone §", []),
    ],
)
def test_citation_forms(text, sections):
    assert [s for _, s in citations(text)] == sections


def test_headings_resolve_exactly_their_own_section():
    spec = "# Title §1\n\n## §3 Entropy\n### §3.2 Window\n```\n# §7 in a code block\n```\ntext §8\n"
    assert spec_headings(spec) == {"1", "3", "3.2"}
    assert spec_headings("### §3.2 Window\n") == {"3.2"}  # §3 needs its own heading
