"""The metric names a PromQL expression reads, and the series names a scraped registry exports.

Enough of PromQL for the dashboard's expressions, with no evaluation: strings, label
matchers (`{...}`), range and subquery brackets (`[...]`) and grouping clauses (`by (...)`,
`on (...)`, ...) are cut out; what is left of the identifiers, less functions and aggregations
(followed by `(`), keywords and numbers, are metric names. A scraped family exports the series
its type defines (Prometheus' text format): a counter `x` as `x_total`, a histogram as
`x_bucket`, `x_count` and `x_sum`, a gauge as `x`; so a name resolves only with the suffix its
family's type allows, and `x_total` of a gauge, or `x_bucket` of a counter, does not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
# Durations and numbers first, so that `5m`, `1e3` or `0x1f` is not read as a name after its
# leading digit.
_TOKEN = re.compile(
    r"(?P<duration>(?:\d+(?:ms|[smhdwy]))+)"
    r"|(?P<number>0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
    r"|\$(?P<variable>\w+)"
    r"|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<call>\s*\()?"
)
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "inf", "nan"}
    | {"group_left", "group_right", "start", "end"}
)
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+),)?\s*\w+\s*\)\s*$")

SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum"),
    "gauge": ("",),
    "unknown": ("",),
    "info": ("_info",),
    "stateset": ("",),
}


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects, as written (with any _total/_bucket/... suffix)."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    while _BRACKETS.search(text):  # subqueries nest: [5m:1m] inside rate(...[...])
        text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for token in _TOKEN.finditer(text):
        name = token.group("name")
        if name is None or token.group("call") or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def variable_metric_names(query: str) -> set[str]:
    """The metric names a Grafana Prometheus variable's query reads: `label_values(selector,
    label)` reads the selector's; `label_values(label)` reads none; another query is PromQL."""
    match = _LABEL_VALUES.match(query)
    if match is None:
        return metric_names(query)
    selector = match.group("selector")
    return metric_names(selector) if selector else set()


def exported_series(exposition: str) -> dict[str, str]:
    """Every series name the exposition text's families define -> its family's name."""
    series = {}
    for family in text_string_to_metric_families(exposition):
        for suffix in SUFFIXES.get(family.type, ("",)):
            series[family.name + suffix] = family.name
    return series


def unknown_names(exprs: Iterable[str], series: dict[str, str]) -> dict[str, set[str]]:
    """Each expression that reads a name `series` lacks -> those names."""
    missing = {}
    for expr in exprs:
        names = metric_names(expr) - series.keys()
        if names:
            missing[expr] = names
    return missing
