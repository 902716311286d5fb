"""The README and docs/ say only what exists: every relative link reaches a file (and its anchor a
heading there), every section a comment or page cites (`docs/design.md "Section"`) is a heading or
a bold run-in of that page, and every command they name runs: a `switchyard` subcommand and its
flags, a `deploy/dev.sh` command, a script or a file of the checkout."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from switchyard.deploy.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
# The pages a reader is sent to: the README, docs/ and the two READMEs beside the code.
PAGES = sorted([REPO / "README.md", REPO / "tests" / "README.md", REPO / "bench" / "README.md",
                *(REPO / "docs").rglob("*.md")])
# Where a citation of a page's section may stand: the pages themselves and the code's comments.
CITING_FOLDERS = ("docs", "proto", "deploy", "worker", "bench", "tests", "fixtures", ".ci",
                  "gateway", "scheduler", "kvstore")
CITING_SUFFIXES = {".py", ".md", ".sh", ".toml", ".js", ".html", ".css", ""}
# Top-level folders whose paths a page names in backquotes.
TREES = ("bench", "tests", "deploy", "fixtures", "gateway", "scheduler", "worker", "kvstore",
         "proto", "docs", ".ci")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A page and its quoted section, which a comment or docstring may carry over to the next line.
CITATION = re.compile(r'((?:docs/)?[\w./-]*\.md|README)((?:(?: |\n\s*(?:#\s*)?)"[^"\n]+")'
                      r'(?:,\s*"[^"\n]+")*)')
CODE_SPAN = re.compile(r"``?([^`\n]+?)``?")
FENCE = re.compile(r"(?ms)^```[^\n]*\n(.*?)^```")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    return [m.group(1).strip() for m in re.finditer(r"(?m)^#{1,6} (.+)$", text)]


def sections(path: Path) -> set[str]:
    """Names a citation may use: each heading, with and without a trailing "(...)" or ": ...",
    and each bold run-in (`**Failures.** ...`)."""
    names = set()
    for h in headings(path):
        names |= {h, re.sub(r" \(.*\)$", "", h), h.split(":")[0]}
    names |= {b.rstrip(".") for b in re.findall(r"\*\*([^*\n]+?)\*\*", path.read_text())}
    return names


def broken_links(path: Path) -> list[str]:
    out = []
    text = FENCE.sub("", path.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{rel(path)}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
            out.append(f"{rel(path)}: link to {target}: no such heading")
    return out


def citing_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             *CITING_FOLDERS, "*.md"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    files = [REPO / name for name in listed]
    return [f for f in files if f.suffix in CITING_SUFFIXES and f.is_file()
            and "corpus" not in f.parts and f != Path(__file__)]


def cited_page(name: str, citing: Path) -> Path | None:
    if name == "README":
        return REPO / "README.md"
    for base in (REPO, citing.parent):
        if (base / name).is_file():
            return base / name
    return None


def broken_citations(path: Path) -> list[str]:
    out = []
    text = path.read_text(errors="replace")
    for m in CITATION.finditer(text):
        name, quoted = m.group(1), re.findall(r'"([^"\n]+)"', m.group(2))
        if not (name.startswith("docs/") or name.endswith("README.md") or name == "README"
                or path.is_relative_to(REPO / "docs")):
            continue
        page = cited_page(name, path)
        if page is None:
            out.append(f"{rel(path)}: cites {name}: no such page")
            continue
        known = sections(page)
        # Only the first quoted name must be a section: later ones may be a sub-part named in prose.
        if quoted and quoted[0] not in known | {"Section"}:  # "Section": the form, not a citation
            out.append(f'{rel(path)}: cites {name} "{quoted[0]}": no such section')
    return out


def spans(path: Path) -> list[str]:
    """Each code span's text and each line of each fenced block."""
    text = path.read_text()
    out = [line for block in FENCE.findall(text) for line in block.splitlines()]
    out += CODE_SPAN.findall(FENCE.sub("", text))
    return out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    names = {s for a in parser._actions for s in a.option_strings}
    return names | {"--no-" + n[2:] for n in names if n.startswith("--")}


def check_switchyard(words: list[str], where: str) -> list[str]:
    """`switchyard A B --flag ...`: each subcommand exists, each flag is one of the last one's."""
    parser, out = build_parser(), []
    rest = words[1:]
    while rest and not rest[0].startswith("-") and subcommands(parser):
        choices = subcommands(parser)
        if rest[0] not in choices:
            if rest[0].isupper() or rest[0] in {"...", "|"}:  # a placeholder: COMMAND, ...
                return out
            if "|" in rest[0]:  # `launchd install|uninstall|status`
                return [f"{where}: switchyard ... {c}: no such command"
                        for c in rest[0].split("|") if c not in choices]
            return [f"{where}: `switchyard {rest[0]}`: no such command"]
        parser, rest = choices[rest[0]], rest[1:]
    known = options(parser)
    for word in rest:
        flag = word.split("=")[0]
        if re.fullmatch(r"--[a-z][a-z0-9-]*", flag) and flag not in known:
            out.append(f"{where}: `{' '.join(words[:3])} ... {flag}`: no such flag")
    return out


def dev_sh_commands() -> set[str]:
    text = (REPO / "deploy" / "dev.sh").read_text()
    return set(re.findall(r"(?m)^  ([a-z-]+)\)$", text))


def broken_commands(path: Path) -> list[str]:
    out = []
    where = rel(path)
    for span in spans(path):
        line = re.sub(r"^\s*(\$|#)?\s*", "", span)
        words = line.split()
        for i, word in enumerate(words):
            if word in {"switchyard", ".venv/bin/switchyard"} and (i == 0 or words[i - 1] in {
                    "or:", "&&", ";", "|", "exec", "then"}):
                out += check_switchyard(words[i:], where)
            if word == "deploy/dev.sh" and i + 1 < len(words) and \
                    re.fullmatch(r"[a-z-]+", words[i + 1]) and \
                    words[i + 1] not in dev_sh_commands():
                out.append(f"{where}: `deploy/dev.sh {words[i + 1]}`: no such command")
            if word == "serve" and i > 0 and words[i - 1] == "deploy/dev.sh":
                out += check_switchyard(["switchyard", *words[i:]], where)
            if i > 0 and words[i - 1] == "-m" and re.fullmatch(r"[a-z_][\w.]*", word) and \
                    word.split(".")[0] in TREES:
                module = REPO / Path(*word.split("."))
                if not (module.with_suffix(".py").exists() or module.is_dir()):
                    out.append(f"{where}: `python -m {word}`: no such module")
        for token in re.findall(r"(?<![\w./<~-])((?:%s)/[\w./*-]*)" % "|".join(
                re.escape(t) for t in TREES), line):
            token = token.rstrip(".,;:")
            if "..." in token or token.endswith("-"):
                continue
            if not (any(REPO.glob(token)) if "*" in token else (REPO / token).exists()):
                out.append(f"{where}: `{token}`: no such file")
    # A flag table's first column names `switchyard serve` flags.
    for m in re.finditer(r"(?m)^\| (`--[^|]+)\|", FENCE.sub("", path.read_text())):
        for flag in re.findall(r"`(--[a-z][a-z0-9-]*)`", m.group(1)):
            if flag not in options(subcommands(build_parser())["serve"]):
                out.append(f"{where}: flag table: `{flag}`: not a `switchyard serve` flag")
    return out


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_command_and_path_named_exists(page):
    assert broken_commands(page) == []


def test_every_cited_section_exists():
    broken = [b for f in citing_files() for b in broken_citations(f)]
    assert broken == []


def test_the_readme_is_short_and_links_each_topic():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    for page in ("clients", "operations", "models", "security", "performance", "design"):
        assert f"(docs/{page}.md)" in readme, page
    contents = (REPO / "docs" / "README.md").read_text()
    for page in sorted((REPO / "docs").rglob("*.md")):
        if page.name != "README.md":
            assert f"({page.relative_to(REPO / 'docs')})" in contents, page


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "design.md").write_text("# Another page\n")
    page = tmp_path / "probe.md"
    page.write_text('# Probe\n\n[gone](nowhere.md), [here](design.md#no-such-heading)\n'
                    '`switchyard serve --no-such-flag`, `switchyard nosuch`, '
                    '`deploy/dev.sh nosuch`, `bench/nosuch.py`\n'
                    'docs/design.md "No such section"\n')
    assert len(broken_links(page)) == 2
    assert len(broken_commands(page)) == 4
    assert len(broken_citations(page)) == 1


# Issue numbers mean nothing to a reader without the tracker: sections are named by topic.
ISSUE_LABEL = re.compile(r"\b[Ii]ssues? #?\d+|\bF(?:[1-9]|1[0-2])\b|\b[Ff]inding \d+")
NO_ISSUE_FOLDERS = ("docs", "proto", "deploy", "worker", "gateway", "scheduler", "kvstore",
                    "bench", "tests", "fixtures", ".ci")


def test_no_issue_numbers_in_docs_or_code():
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             *NO_ISSUE_FOLDERS, "*.md"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in listed:
        path = REPO / name
        if path.suffix not in CITING_SUFFIXES or not path.is_file() or "corpus" in path.parts \
                or path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ISSUE_LABEL.search(line):
                found.append(f"{name}:{n}: {line.strip()}")
    assert found == []
