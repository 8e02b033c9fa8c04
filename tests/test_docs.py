"""The user documents hold their promises: a short README whose set-up
commands are the ones CI runs, links that resolve, result files that exist,
and a repository that speaks of itself alone.

Standard library and pytest only; every check is a function that a planted
fault makes fail (the ``test_planted_*`` tests).
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CI = ROOT / ".ci" / "run"

#: The README stays short; new features add lines, so aim well below.
README_MAX_LINES = 260

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
#: ``[text](target)`` and ``![alt](target)``; the target up to a space or ``)``.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_RESULT_PATH = re.compile(r"benchmarks/results/[\w.*/\-]*")
#: A repository path in backticks: `scripts/x.py`, `gearbx_mlx/packed/`, `tests/test_*.py`.
_REPO_PATH = re.compile(
    r"`((?:gearbx_mlx|scripts|tests|docs|benchmarks|kernels|csrc|metal_kernels|\.ci)/[\w.*/\-]*)`"
)

# -- what the repository must not say ----------------------------------------------
def _j(*parts: str) -> str:
    """Join ``parts``: the patterns below are assembled from pieces so that this
    file never contains the text it forbids (a plain grep finds nothing here)."""
    return "".join(parts)


FORBIDDEN: Sequence[Tuple[str, "re.Pattern[str]"]] = (
    ("a numbered development round", re.compile(_j(r"\b(?:sess", r"ion|rou", r"nd|spri", r"nt)[ -]?#?\d+\b"), re.I)),
    ("an issue number", re.compile(_j(r"\biss", r"ues?[ -]?#?\d+\b|(?<![\w&#/])#\d+\b"), re.I)),
    ("a note outside the repository", re.compile(re.escape(_j("FAC", "TS.md")) + "|" + re.escape(_j("STY", "LE.md")))),
    ("a path outside the repository", re.compile("|".join(
        re.escape(p) for p in (_j("..", "/shared"), _j("/tmp", "/site"), _j("/wor", "k/"))))),
    ("a machine on loan", re.compile(_j(r"\ble", r"nt\b"), re.I)),
    ("an unnamed machine", re.compile(_j(r"\bthis\s+V", r"M\b"), re.I)),
)


def forbidden_hits(name: str, text: str) -> List[str]:
    """``name:line: what (matched text)`` for every forbidden phrase in ``text``."""
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            for m in pattern.finditer(line):
                hits.append(f"{name}:{lineno}: {what} ({m.group(0)!r})")
    return hits


def tracked_files(root: Path) -> List[Path]:
    """Tracked files of the checkout (skips the test without git)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed: cannot list the repository's tracked files")
    proc = subprocess.run([git, "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=30)
    if proc.returncode != 0:
        reason = proc.stderr.decode(errors="replace").strip().splitlines()
        pytest.skip(f"not a git checkout ({reason[0] if reason else 'git ls-files failed'})")
    names = [n for n in proc.stdout.decode("utf-8", errors="replace").split("\0") if n]
    return [p for p in (root / n for n in names) if p.is_file()]


def text_of(path: Path) -> str:
    """The file as text, or "" for a binary file (a NUL byte in its first 8 KiB)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return ""
    return data.decode("utf-8", errors="replace")


# -- Markdown structure ------------------------------------------------------------
def outside_fences(text: str) -> Iterable[Tuple[int, str]]:
    """``(line number, line)`` of the lines not inside a fenced code block."""
    in_fence = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield lineno, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set:
    """Every heading anchor of a Markdown text (repeated headings get ``-1``, ``-2``...)."""
    seen: Dict[str, int] = {}
    out = set()
    for _, line in outside_fences(text):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path, root: Path) -> List[str]:
    """``doc:line target (why)`` for each relative link of ``doc`` that does not resolve.

    A link resolves when its file exists (relative to ``doc``, inside ``root``)
    and, with ``#anchor``, that Markdown file has a heading with that anchor.
    """
    text = doc.read_text(encoding="utf-8")
    bad = []
    for lineno, line in outside_fences(text):
        for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc.resolve()
            where = f"{doc.relative_to(root).as_posix()}:{lineno} {target}"
            if root.resolve() not in dest.parents and dest != root.resolve():
                bad.append(f"{where} (points outside the repository)")
            elif not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{where} (no heading with anchor #{anchor})")
    return bad


def missing_results(doc: Path, root: Path) -> List[str]:
    """``doc:line path`` for each ``benchmarks/results/...`` path named in ``doc`` that is absent."""
    bad = []
    for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for m in _RESULT_PATH.finditer(line):
            rel = m.group(0).rstrip(".,;:")
            found = glob.glob(str(root / rel)) if "*" in rel else [str(root / rel)] if (root / rel).exists() else []
            if not found:
                bad.append(f"{doc.relative_to(root).as_posix()}:{lineno} {rel}")
    return bad


def missing_paths(doc: Path, root: Path) -> List[str]:
    """``doc:line path`` for each repository path in backticks in ``doc`` that is absent.

    Files move (kernel sources, modules); a document that names the old place
    is caught here.
    """
    bad = []
    for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for m in _REPO_PATH.finditer(line):
            rel = m.group(1)
            if not (glob.glob(str(root / rel)) if "*" in rel else (root / rel).exists()):
                bad.append(f"{doc.relative_to(root).as_posix()}:{lineno} {rel}")
    return bad


def section(text: str, title: re.Pattern) -> List[str]:
    """The lines of the ``##`` section whose title matches ``title`` (without its heading)."""
    lines = text.splitlines()
    out: List[str] = []
    inside, in_fence = False, False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        m = None if in_fence else _HEADING.match(line)
        if m and len(m.group(1)) <= 2:
            if inside:
                break
            inside = bool(title.search(m.group(2)))
            continue
        if inside:
            out.append(line)
    return out


def fenced_commands(lines: Sequence[str]) -> List[List[str]]:
    """The command lines (not blank, not comments) of each fenced block in ``lines``."""
    blocks: List[List[str]] = []
    current = None
    for line in lines:
        if _FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None and line.strip() and not line.lstrip().startswith("#"):
            current.append(line.strip())
    return blocks


SETUP_TITLE = re.compile(r"set[- ]?up", re.I)


def setup_commands(readme_text: str) -> List[List[str]]:
    return fenced_commands(section(readme_text, SETUP_TITLE))


def documents() -> List[Path]:
    return [README] + sorted(DOCS.glob("*.md"))


# -- the checks ----------------------------------------------------------------------
def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/DESIGN.md "
        "or docs/BENCHMARKS.md and link to it"
    )


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second():
    blocks = setup_commands(README.read_text(encoding="utf-8"))
    assert len(blocks) == 2, f"the set-up section of README.md must hold two fenced commands, found {len(blocks)}"
    assert all(len(b) == 1 for b in blocks), f"each set-up block must be one command line: {blocks}"
    install, test = blocks[0][0], blocks[1][0]
    venv = "python3 -m venv .venv && . .venv/bin/activate && "
    assert install.startswith(venv) and test.startswith(venv), "both set-up commands start in a fresh venv"
    assert "pip install -e . " in install and "python -m gearbx_mlx.generate --prompt" in install
    assert 'pip install -e ".[test]"' in test and test.endswith("python -m pytest")
    # CI runs the README's test command, so the command a reader types is tested.
    assert test[len(venv):] in CI.read_text(encoding="utf-8"), (
        f"{CI.relative_to(ROOT)} no longer runs README.md's test command {test[len(venv):]!r}"
    )


def test_every_relative_link_resolves():
    docs = documents()
    assert len(docs) >= 3, f"expected README.md and docs/*.md, found {[d.name for d in docs]}"
    bad = [b for d in docs for b in broken_links(d, ROOT)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_named_result_file_exists():
    bad = [b for d in documents() for b in missing_results(d, ROOT)]
    assert not bad, "documents name result files that are not in benchmarks/results/:\n" + "\n".join(bad)


def test_every_named_repository_path_exists():
    bad = [b for d in documents() for b in missing_paths(d, ROOT)]
    assert not bad, "documents name paths that are not in the repository (moved?):\n" + "\n".join(bad)


def test_the_repository_speaks_of_itself_alone():
    this = Path(__file__).resolve()
    files = [f for f in tracked_files(ROOT) if f.resolve() != this]
    assert any(f.name == "README.md" for f in files), "git ls-files did not list README.md"
    hits = [h for f in files for h in forbidden_hits(f.relative_to(ROOT).as_posix(), text_of(f))]
    assert not hits, "say it in the repository's own terms:\n" + "\n".join(hits)


# -- each check fails on a planted fault -----------------------------------------------
@pytest.mark.parametrize("phrase", [
    _j("as measured in sess", "ion 2"), _j("fixed in rou", "nd 3"), _j("see iss", "ue 7"), _j("closes #", "12"),
    _j("from FAC", "TS.md"), _j("per STY", "LE.md"), _j("read ../", "shared/x"), _j("under /tmp/", "site"),
    _j("in /", "work/main"), _j("on the le", "nt GPU"), _j("on this ", "VM"),
])
def test_planted_forbidden_phrase_is_reported(phrase):
    assert forbidden_hits("x.md", f"text\n{phrase}\n"), phrase


@pytest.mark.parametrize("fine", [
    "median of 3 interleaved rounds", "--rounds 3", "RoutingSession", "a session-level monitor",
    "the host's cost per kernel call", "§13.3", "#define GBX_QK 32", "silent", "excellent",
    "benchmarks/results/eval_default.json", "the issue is open", "x86-64 Linux VM",
])
def test_ordinary_text_is_not_reported(fine):
    assert not forbidden_hits("x.md", fine), fine


def test_planted_broken_links_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "B.md").write_text("# B\n\n## Real heading: yes\n", encoding="utf-8")
    doc = tmp_path / "README.md"
    doc.write_text(
        "[ok](docs/B.md) [ok](docs/B.md#real-heading-yes) [web](https://example.com) [self](#a)\n"
        "# A\n"
        "[gone](docs/C.md) [anchor](docs/B.md#nope) [out](../elsewhere.md)\n"
        "```\n[in a fence](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    bad = broken_links(doc, tmp_path)
    assert len(bad) == 3, bad
    assert "docs/C.md (no such file)" in bad[0]
    assert "no heading with anchor #nope" in bad[1]
    assert "points outside the repository" in bad[2]


def test_planted_missing_result_file_is_reported(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "a.json").write_text("{}", encoding="utf-8")
    doc = tmp_path / "README.md"
    doc.write_text("`benchmarks/results/a.json`, benchmarks/results/*.json and benchmarks/results/b.json.\n",
                   encoding="utf-8")
    assert missing_results(doc, tmp_path) == ["README.md:1 benchmarks/results/b.json"]


def test_planted_moved_path_is_reported(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "a.py").write_text("", encoding="utf-8")
    doc = tmp_path / "README.md"
    doc.write_text("`scripts/a.py`, `scripts/*.py`, `scripts/`, `packed/x.py` and `scripts/gone.py`\n",
                   encoding="utf-8")
    assert missing_paths(doc, tmp_path) == ["README.md:1 scripts/gone.py"]


def test_planted_third_setup_command_is_counted():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    heading = next(i for i, line in enumerate(lines) if _HEADING.match(line) and SETUP_TITLE.search(line))
    planted = "\n".join(lines[: heading + 1] + ["", "```bash", "make install", "```"] + lines[heading + 1:])
    assert len(setup_commands(planted)) == len(setup_commands(text)) + 1


def test_slug_matches_github_anchors():
    assert slug("Trace format (JSON Lines)") == "trace-format-json-lines"
    assert slug("Evaluation: does entropy routing pay?") == "evaluation-does-entropy-routing-pay"
    assert slug("The remote backend's entropy bounds") == "the-remote-backends-entropy-bounds"
    assert slug("§3.1 Shannon entropy") == "31-shannon-entropy"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
