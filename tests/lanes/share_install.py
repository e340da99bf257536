"""Hard-link installed distributions from this interpreter's environment into another one.

Run by the environment that holds them: python share_install.py TARGET_SITE_PACKAGES NAME==VERSION...
Each named distribution that is installed here at exactly that version is linked, with every distribution it
requires (markers evaluated here), file by file as its RECORD lists them, dist-info included, so that pip in the
target finds them installed and does not copy them again. A name installed at another version is skipped (pip
installs it); files outside site-packages (console scripts) are not linked. Nothing is written through a link:
pip replaces a file by unlinking it first, so the source environment never changes.

Prints what it linked; exits 0 even when it linked nothing (pip then installs everything).
"""

import importlib.metadata as metadata
import os
import re
import sys
from pathlib import Path


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _required_names(dist: metadata.Distribution) -> list[str]:
    """The names a distribution requires in this environment (its markers evaluated, extras left out)."""
    from packaging.requirements import Requirement

    names = []
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.append(requirement.name)
    return names


def _closure(roots: dict[str, str]) -> list[metadata.Distribution]:
    """The distributions pinned in `roots` (name -> version) that are installed at that version, with all they
    require that is installed here."""
    found: dict[str, metadata.Distribution] = {}
    pending = []
    for name, version in roots.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            print(f"share_install: {name} is not installed here; pip installs it")
            continue
        if dist.version != version:
            print(f"share_install: {name} is {dist.version} here, not {version}; pip installs it")
            continue
        pending.append(dist)
    while pending:
        dist = pending.pop()
        key = _canonical(dist.metadata["Name"])
        if key in found:
            continue
        found[key] = dist
        for name in _required_names(dist):
            try:
                pending.append(metadata.distribution(name))
            except metadata.PackageNotFoundError:
                pass
    return list(found.values())


def _link(dist: metadata.Distribution, source: Path, target: Path) -> int:
    """Link one distribution's files; on any failure remove what this call linked and re-raise."""
    linked: list[Path] = []
    try:
        # dist-info last: pip counts the distribution installed only once every file is there
        files = sorted(dist.files or [], key=lambda file: ".dist-info/" in str(file).replace(os.sep, "/"))
        for file in files:
            origin = (source / file).resolve()
            if not origin.is_relative_to(source) or not origin.is_file():
                continue
            destination = target / origin.relative_to(source)
            if destination.exists():
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.link(origin, destination)
            linked.append(destination)
    except OSError:
        for destination in linked:
            destination.unlink(missing_ok=True)
        raise
    return sum(path.stat().st_size for path in linked)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(argv[0]).resolve()
    roots = {}
    for pin in argv[1:]:
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+_-]+)", pin)
        if match is None:
            print(f"share_install: '{pin}' is not NAME==VERSION", file=sys.stderr)
            return 2
        roots[match.group(1)] = match.group(2)
    total = 0
    for dist in _closure(roots):
        source = Path(dist.locate_file("")).resolve()
        try:
            total += _link(dist, source, target)
        except OSError as error:
            print(f"share_install: could not link {dist.metadata['Name']} ({error}); pip installs the rest")
            break
    print(f"share_install: linked {total / 2**30:.2f} GiB from {sys.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
