"""Print kvstore's runtime requirements (core + redis, s3, codec extras) one a line,
leaving out the named distributions, which the base image already provides.

Used by compose/Dockerfile's serving stage:  python3 requirements_without.py torch lmcache
Must not touch: pyproject.toml (it only reads it); needs Python >= 3.11 (tomllib).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

EXTRAS = ("redis", "s3", "codec")


def distribution(requirement: str) -> str:
    """`redis[hiredis]>=5.0` -> `redis`, normalised as pip compares names."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if name is None:
        raise SystemExit(f"cannot read a distribution name from {requirement!r} in pyproject.toml")
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def main(argv: list[str]) -> None:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    skip = {distribution(name) for name in argv}
    for requirement in dict.fromkeys(wanted):
        if distribution(requirement) not in skip:
            print(requirement)


if __name__ == "__main__":
    main(sys.argv[1:])
