"""Names spliced into SQL: only plain identifiers pass.

Database and cluster names end up in DDL and `USE` statements, where a bound
parameter cannot go. The client, migrations, the traffic reader and the
sink's read-only HTTP server all check names here, so none of them has to
import another for it.
"""

from __future__ import annotations

import re

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def checked_identifier(name: str, what: str = "database") -> str:
    """`name` itself, or ValueError naming what it was meant to be."""
    if not IDENTIFIER.match(name):
        raise ValueError(f"{what} name {name!r} must match {IDENTIFIER.pattern}")
    return name
