"""The user's documents hold together: every relative Markdown link (and image) in README.md, CONTRIBUTING.md,
docs/*.md and bench/results/README.md names a file or folder inside the repository, and a link to a heading of a
Markdown file names a heading that file has; the repository paths quoted in backticks (``bench/results/...``,
``tests/...``, ...) exist; the README stays a page for users (at most 200 lines) and keeps its two commands word for
word, which the test scripts, ``.ci/run`` and tests/host/test_readme_commands.py run."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "results" / "README.md",
]
README_LINES = 200
COMMANDS = [
    "    bash tests/run_example.sh         # set up, run the FL2VA example in a real ComfyUI server, print the mp4",
    "    bash tests/run.sh                 # set up, run every test",
]

# a link's text may run over a line break; its target may not
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(?P<code>[^\n]+?)\1")
# backticked paths of this repository worth checking: they start at one of its top-level folders
REPO_PATH = re.compile(r"^(?:bench|tests|h3_core|nodes|workflows|docs|\.ci)/[\w./*<>-]*$")


def prose(path: Path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def without_code(text: str) -> str:
    """``text`` with its code spans blanked, every other character where it was."""
    return CODE_SPAN.sub(lambda m: " " * len(m[0]), text)


def links(path: Path):
    """(line number, target) of every link and image outside code, a link's text running over lines included."""
    lines = dict(prose(path))
    text = "\n".join(lines.get(n, "") for n in range(1, max(lines, default=0) + 1))
    for match in LINK.finditer(without_code(text)):
        yield text.count("\n", 0, match.start()) + 1, match["target"]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, code marks and punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found = set()
    for _, line in prose(path):
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            found.add(slug(heading[1]))
    return found


def where(path: Path, number: int) -> str:
    return f"{path.relative_to(ROOT)}:{number}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_every_relative_link_names_a_file_of_the_repository(path):
    broken = []
    for number, target in links(path):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{where(path, number)}: {target} leaves the repository")
        elif not resolved.exists():
            broken.append(f"{where(path, number)}: {target} names nothing ({resolved.relative_to(ROOT)} is missing)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{where(path, number)}: {target}: {resolved.relative_to(ROOT)} has no heading #{anchor}")
    assert broken == [], "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_every_backticked_repository_path_exists(path):
    missing = []
    for number, line in prose(path):
        for match in CODE_SPAN.finditer(line):
            quoted = match["code"].strip()
            if not REPO_PATH.match(quoted) or "<" in quoted:
                continue
            if "*" in quoted:
                if not list(ROOT.glob(quoted)):
                    missing.append(f"{where(path, number)}: `{quoted}` matches nothing")
            elif not (ROOT / quoted).exists():
                missing.append(f"{where(path, number)}: `{quoted}` is not in the repository")
    assert missing == [], "paths that do not exist:\n" + "\n".join(missing)


def test_the_readme_is_a_page_for_users():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, (
        f"README.md has {len(lines)} lines, at most {README_LINES}: move the detail to docs/ or CONTRIBUTING.md"
    )


def test_the_readme_keeps_its_two_commands_word_for_word():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    for command in COMMANDS:
        assert command in lines, f"README.md lost the line {command.strip()!r} (tests and .ci/run depend on it)"


def test_the_link_reader_finds_what_it_should():
    """The checks above are only as good as the reading: links in prose found, code left alone, anchors as
    GitHub makes them."""
    assert slug("VDN-H3 on ComfyUI's native H3") == "vdn-h3-on-comfyuis-native-h3"
    assert slug("The low-VRAM policy") == "the-low-vram-policy"
    assert slug("Using `h3_core` as a library") == "using-h3_core-as-a-library"
    text = (
        "see [a](docs/a.md#b), ![p](docs/images/x.png), `[not](a link)`,\n[a long\nname](c.md) and [web](https://e.org)"
    )
    found = [m["target"] for m in LINK.finditer(without_code(text))]
    assert found == ["docs/a.md#b", "docs/images/x.png", "c.md", "https://e.org"]


def test_the_results_index_names_every_result():
    """Every file under bench/results is named in its index, by a link or a backticked name or pattern, and every
    name there matches a file: a new result is listed where a newcomer looks for it."""
    results = ROOT / "bench" / "results"
    index = (results / "README.md").read_text(encoding="utf-8")
    named = {m["target"] for m in LINK.finditer(index)} | {m["code"] for m in CODE_SPAN.finditer(index)}
    patterns = [name for name in named if re.fullmatch(r"[\w*-]+\.(json|md)", name)]
    covered = set()
    for pattern in patterns:
        matched = {path.name for path in results.glob(pattern)}
        assert matched, f"bench/results/README.md names {pattern!r}, which matches no file there"
        covered |= matched
    missing = sorted(path.name for path in results.iterdir() if path.name != "README.md" and path.name not in covered)
    assert not missing, f"bench/results/README.md does not name {missing}"
