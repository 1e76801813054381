"""File names inside a container: plain names only, so nothing a manifest says can reach outside its directory."""

from __future__ import annotations

import re

from .errors import FormatError

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def check_file_name(name: object) -> str:
    """Return `name` if it is a plain file name (no directories, no '..', no hidden tricks); raise otherwise."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise FormatError(
            f"file name {name!r} is not a plain file name inside the container (path traversal or odd characters)"
        )
    return name
