"""Just enough PromQL to evaluate the Grafana dashboard's expressions over scraped /metrics.

Selectors with label matchers, `rate`/`increase` over a range, `sum`/`max`/`min`/`avg` (with
`by`), `histogram_quantile` and `/`: what compose/observability/grafana/dashboards/*.json
uses. Approximate where Prometheus is subtle: `rate` is the plain first-to-last slope over
the range and `increase` the plain difference (no extrapolation to the range's ends); a
counter reset restarts from zero.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset  # of (name, value) pairs
Vector = dict  # Labels -> float


@dataclass
class Scrape:
    """Every sample of every target at one moment (time.time() seconds)."""

    t: float
    samples: dict[tuple[str, Labels], float]


def parse_scrape(t: float, targets: dict[str, str]) -> Scrape:
    """`targets`: instance (host:port) -> metrics text; each series gets an `instance` label,
    as Prometheus adds it."""
    samples = {}
    for instance, text in targets.items():
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, Labels({**s.labels, "instance": instance}.items()))] = s.value
    return Scrape(t, samples)


_TOKEN = re.compile(
    r'\s*(?:(?P<num>\d+(?:\.\d+)?(?:[smh]\b)?)|(?P<str>"[^"]*")'
    r"|(?P<id>[A-Za-z_:][\w:]*)|(?P<op>=~|!~|!=|[(){}\[\],=/]))"
)


def _tokens(expr: str) -> list[str]:
    out, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:]!r}")
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


def _seconds(duration: str) -> float:
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


class _Parser:
    """expr := term ('/' term)*; term := agg [by (labels)] (expr) | rate|increase(selector[range])
    | histogram_quantile(q, expr) | (expr) | selector."""

    AGGS = {"sum": sum, "max": max, "min": min, "avg": lambda v: sum(v) / len(v)}

    def __init__(self, expr: str) -> None:
        self.toks, self.i = _tokens(expr), 0

    def take(self, expected: str | None = None) -> str:
        tok = self.toks[self.i]
        if expected is not None and tok != expected:
            raise ValueError(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def expr(self):
        left = self.term()
        while self.peek() == "/":
            self.take()
            left = ("div", left, self.term())
        return left

    def labels_list(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return tuple(names)

    def term(self):
        tok = self.take()
        if tok in self.AGGS:
            by = None
            if self.peek() == "by":
                self.take()
                by = self.labels_list()
            self.take("(")
            inner = self.expr()
            self.take(")")
            return ("agg", tok, by, inner)
        if tok in ("rate", "increase"):
            self.take("(")
            sel = self.selector(self.take())
            self.take("[")
            window = _seconds(self.take())
            self.take("]")
            self.take(")")
            return (tok, sel, window)
        if tok == "histogram_quantile":
            self.take("(")
            q = float(self.take())
            self.take(",")
            inner = self.expr()
            self.take(")")
            return ("quantile", q, inner)
        if tok == "(":
            inner = self.expr()
            self.take(")")
            return inner
        return self.selector(tok)

    def selector(self, name: str):
        matchers = []
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), self.take()[1:-1]
                matchers.append((label, op, value))
                if self.peek() == ",":
                    self.take()
            self.take("}")
        return ("sel", name, tuple(matchers))


def _matches(labels: dict[str, str], matchers) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        ok = {
            "=": have == value,
            "!=": have != value,
            "=~": re.fullmatch(value, have) is not None,
            "!~": re.fullmatch(value, have) is None,
        }[op]
        if not ok:
            return False
    return True


class Evaluator:
    def __init__(self, scrapes: list[Scrape]) -> None:
        self.scrapes = scrapes

    def eval(self, node, i: int) -> Vector:
        """The instant vector of `node` at scrape `i`."""
        kind = node[0]
        if kind == "sel":
            return self._select(node, self.scrapes[i])
        if kind in ("rate", "increase"):
            _, sel, window = node
            t = self.scrapes[i].t
            points = [s for s in self.scrapes[: i + 1] if s.t >= t - window]
            if len(points) < 2:
                return {}
            first, last = self._select(sel, points[0]), self._select(sel, points[-1])
            span = points[-1].t - points[0].t
            out = {}
            for labels, v in last.items():
                if labels in first:
                    delta = v - first[labels] if v >= first[labels] else v  # counter reset
                    out[labels] = delta / span if kind == "rate" else delta
            return out
        if kind == "agg":
            _, op, by, inner = node
            groups: dict[Labels, list[float]] = {}
            for labels, v in self.eval(inner, i).items():
                key = Labels((k, val) for k, val in labels if by is not None and k in by)
                groups.setdefault(key, []).append(v)
            return {k: _Parser.AGGS[op](vs) for k, vs in groups.items()}
        if kind == "quantile":
            return self._quantile(node[1], self.eval(node[2], i))
        if kind == "div":
            left, right = self.eval(node[1], i), self.eval(node[2], i)
            return {k: v / right[k] for k, v in left.items() if right.get(k)}
        raise ValueError(kind)

    def _select(self, sel, scrape: Scrape) -> Vector:
        _, name, matchers = sel
        return {
            labels: v
            for (n, labels), v in scrape.samples.items()
            if n == name and _matches(dict(labels), matchers)
        }

    @staticmethod
    def _quantile(q: float, buckets: Vector) -> Vector:
        """Prometheus' histogram_quantile: linear inside the bucket the rank falls in."""
        series: dict[Labels, list[tuple[float, float]]] = {}
        for labels, v in buckets.items():
            le = dict(labels).get("le")
            if le is not None:
                rest = Labels(kv for kv in labels if kv[0] != "le")
                series.setdefault(rest, []).append((float(le), v))
        out = {}
        for labels, points in series.items():
            points.sort()
            total = points[-1][1]
            if total <= 0:
                continue
            rank, prev_le, prev_count = q * total, 0.0, 0.0
            for le, count in points:
                if count >= rank:
                    if math.isinf(le):
                        out[labels] = prev_le
                    else:
                        out[labels] = prev_le + (le - prev_le) * (
                            (rank - prev_count) / (count - prev_count) if count > prev_count else 1
                        )
                    break
                prev_le, prev_count = le, count
        return out


def panel_series(evaluator: Evaluator, target: dict, substitutions: dict[str, str]):
    """{legend: ([t], [value])} of one panel target over every scrape."""
    expr = target["expr"]
    for name, value in substitutions.items():
        expr = expr.replace(name, value)
    node = parse(expr)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for i, scrape in enumerate(evaluator.scrapes):
        for labels, v in evaluator.eval(node, i).items():
            if math.isnan(v):
                continue
            names = dict(labels)
            legend = re.sub(
                r"\{\{\s*(\w+)\s*\}\}",
                lambda m: names.get(m.group(1), ""),
                target.get("legendFormat") or "",
            ) or (", ".join(f"{k}={val}" for k, val in sorted(names.items())) or expr)
            ts, vs = series.setdefault(legend, ([], []))
            ts.append(scrape.t)
            vs.append(v)
    return series


def parse(expr: str):
    """The expression's syntax tree, for `Evaluator.eval`."""
    return _Parser(expr).expr()
