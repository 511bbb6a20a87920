"""Panel SQL comes from `pipeline.core.store.queries.QUERIES` and from nowhere else.

The report, the Grafana panels and the local board all read the same named
queries; this module is the one door the dashboards use to reach them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.core.store.queries import AnalysisQuery


class MissingQuery(LookupError):
    """A panel names a query that `pipeline.core.store.queries` does not define."""


def all_queries() -> Mapping[str, AnalysisQuery]:
    from pipeline.core.store.queries import QUERIES

    return QUERIES


def query_sql(name: str) -> str:
    """The raw SQL (with Grafana macros) of the named analysis query."""
    queries = all_queries()
    try:
        query = queries[name]
    except KeyError:
        known = ", ".join(sorted(queries))
        raise MissingQuery(f"no query {name!r} in pipeline.core.store.queries.QUERIES (known: {known})") from None
    return query.sql.strip()
