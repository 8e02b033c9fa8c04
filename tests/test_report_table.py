"""The evaluation's policy table: every header column has its value under it (text and Markdown)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gearbx_mlx.evaluation import report


def _row(name: str, low: float, mid: float, kv: float | None) -> dict:
    high = max(0.0, 1.0 - low - mid)
    row = {
        "name": name, "perplexity": 12.345, "mean_kl": 0.0123, "top1_agreement": 0.9,
        "bytes_per_token": 270e6, "relative_bytes": 1.0, "shifts": 7,
        "gear_fractions": {"low": low, "mid": mid, "high": high},
        "speed": {"tokens_per_s": 42.0},
    }
    if kv is not None:
        row["kv_bytes_per_token"] = kv
        row["total_bytes_per_token"] = 270e6 + kv
    return row


TITLES = ("policy", "ppl", "KL nats", "top1", "MB/tok", "rel", "KV MB", "tot MB", "low%", "mid%", "high%",
          "shifts", "tok/s")


def _columns(head: str, line: str) -> dict:
    """Cut ``line`` under each header title (the first left-aligned, the rest right-aligned)."""
    assert head.split() == " ".join(TITLES).split()
    titles = TITLES
    ends, pos = [], 0
    for t in titles:
        pos = head.index(t, pos) + len(t)
        ends.append(pos)
    name = line.split(" ", 1)[0]  # the policy column is left-aligned
    out, start = {"policy": name}, len(name)
    for t, end in zip(titles[1:], ends[1:]):
        out[t.strip()] = line[start:end].strip()
        start = end
    assert line[end:].strip() == "", f"text past the last column: {line[end:]!r}"
    return out


def _expected(r: dict) -> dict:
    f = r["gear_fractions"]
    kv = r.get("kv_bytes_per_token")
    return {
        "ppl": "12.345", "KL nats": "0.0123", "top1": "0.900", "MB/tok": "270.0", "rel": "1.000",
        "KV MB": "" if kv is None else f"{kv / 1e6:.2f}",
        "tot MB": "" if kv is None else f"{(270e6 + kv) / 1e6:.1f}",
        "low%": f"{100 * f['low']:.1f}", "mid%": f"{100 * f['mid']:.1f}", "high%": f"{100 * f['high']:.1f}",
        "shifts": "7", "tok/s": "42.0",
    }


@settings(max_examples=50, deadline=None)
@given(
    low=st.floats(0, 1), mid=st.floats(0, 1),
    kv=st.one_of(st.none(), st.floats(0, 5e6)),
)
def test_every_value_stands_under_its_header(low, mid, kv):
    mid = min(mid, 1 - low)
    rows = [_row("static-high", 0.0, 0.0, kv), _row("dynamic-fixed/all", low, mid, kv)]
    head, rule, *lines = report.table(rows).split("\n")
    assert len(rule) == len(head)
    for r, line in zip(rows, lines):
        assert len(line) <= len(head)
        cols = _columns(head, line)
        assert cols.pop("policy") == r["name"]
        assert cols == _expected(r)


def test_static_high_reads_all_high():
    head, _, line = report.table([_row("static-high", 0.0, 0.0, 1.5e5)]).split("\n")
    cols = _columns(head, line)
    assert (cols["low%"], cols["mid%"], cols["high%"]) == ("0.0", "0.0", "100.0")


def test_markdown_rows_have_as_many_cells_as_the_header():
    for kv in (None, 1.5e5):
        head, rule, line = report.markdown_table([_row("static-high", 0.0, 0.0, kv)]).split("\n")
        assert head.count("|") == rule.count("|") == line.count("|")
        cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in line.split("|")]))
        assert cells["low/mid/high %"] == "0/0/100"
        assert cells["KV MB/token"] == ("" if kv is None else "0.15")
