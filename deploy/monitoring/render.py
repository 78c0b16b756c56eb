"""Render the Grafana dashboard without Grafana: every panel's queries run as range queries against
a Prometheus HTTP API and are plotted with matplotlib, in the dashboard's own rows and order.

    python3 deploy/monitoring/render.py --prometheus http://127.0.0.1:9090 --minutes 15 out.png

For a look at the dashboard as a person would see it (docs/dashboard.png is made this way by
tests/deploy/test_prometheus.py during a loopback load).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "base/grafana-dashboard.json"


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def _format_unit(unit: str):
    def fmt(value, _pos=None):
        if unit == "s":
            if value == 0:
                return "0"
            return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.3g} s"
        if unit == "percentunit":
            return f"{value * 100:.0f}%"
        suffix = "/s" if unit == "reqps" else ""
        for scale, name in ((1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.3g}{name}{suffix}"
        return f"{value:.3g}{suffix}"

    return fmt


def _sort_key(text: str):
    """Natural order, so that le_16 < le_64 < le_512 < gt_512."""
    import re

    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text.replace("gt_", "le~"))]


def fill_variables(expr: str, dashboard: dict, rate_interval: str) -> str:
    """What Grafana sends: $__rate_interval, and every "All" variable as its allValue."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for var in dashboard.get("templating", {}).get("list", []):
        if "allValue" in var:
            expr = expr.replace("$" + var["name"], var["allValue"])
    return expr


def render(dashboard: dict, prometheus: str, start: float, end: float, out: Path,
           rate_interval: str = "1m", step: float | None = None) -> dict[str, int]:
    """Plot every panel; returns the number of series each panel got."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from datetime import datetime

    step = step or max(1.0, (end - start) / 240)
    rows: list[tuple[str, list[dict]]] = []
    for p in dashboard["panels"]:
        if p["type"] == "row":
            rows.append((p["title"], []))
        else:
            rows[-1][1].append(p)
    # each dashboard row is one figure row, its panels side by side as Grafana lays them out (gridPos.w)
    grid = [(title, panels) for title, panels in rows if panels]
    fig = plt.figure(figsize=(20, 3.6 * len(grid) + 1.0), dpi=90)
    spec = fig.add_gridspec(len(grid), 24)
    fig.suptitle(f"{dashboard['title']}   ({datetime.fromtimestamp(start):%H:%M:%S} to "
                 f"{datetime.fromtimestamp(end):%H:%M:%S}, rate window {rate_interval})", fontsize=14, y=0.995)
    counts: dict[str, int] = {}
    last_row = None
    for r, (row_title, panels) in enumerate(grid):
        for c, panel in enumerate(panels):
            x, w = panel["gridPos"]["x"], panel["gridPos"]["w"]
            ax = fig.add_subplot(spec[r, x:x + w])
            n = 0
            colors: dict[str, str] = {}  # one colour per series key (first legend word), one dash per target
            palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
            # targets that share their legend's first word (e.g. "{{model}} mean" / "{{model}} p95")
            # differ by dash; targets with their own names are all solid
            keys = [t.get("legendFormat", "").split(" ")[0] for t in panel["targets"]]
            dashed = len(set(keys)) < len(keys)
            stacked = panel["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode") == "normal"
            lines = []  # (label, times, values, colour, dash)
            for k, target in enumerate(panel["targets"]):
                expr = fill_variables(target["expr"], dashboard, rate_interval)
                results = query_range(prometheus, expr, start, end, step)
                labelled = sorted(((legend(target.get("legendFormat", ""), s["metric"]), s) for s in results),
                                  key=lambda item: _sort_key(item[0]))
                for label, series in labelled:
                    ts = [float(t) for t, _ in series["values"]]
                    ys = [float(v) if math.isfinite(float(v)) else float("nan") for _, v in series["values"]]
                    key = label.split(" ")[0] if len(panel["targets"]) > 1 else label
                    color = colors.setdefault(key, palette[len(colors) % len(palette)])
                    lines.append((label, ts, ys, color, ("-", "--", ":")[k % 3] if dashed else "-"))
            n = len(lines)
            if stacked and lines:  # as Grafana's "normal" stacking: areas on a common time axis
                grid_ts = sorted({t for _, ts, _, _, _ in lines for t in ts})
                values = [[dict(zip(ts, ys)).get(t, 0.0) for t in grid_ts] for _, ts, ys, _, _ in lines]
                values = [[0.0 if math.isnan(v) else v for v in row] for row in values]
                ax.stackplot([datetime.fromtimestamp(t) for t in grid_ts], values, labels=[l[0] for l in lines],
                             colors=[l[3] for l in lines], alpha=0.75)
            else:
                for label, ts, ys, color, dash in lines:
                    ax.plot([datetime.fromtimestamp(t) for t in ts], ys, linewidth=1.4, color=color, linestyle=dash,
                            label=label)
            counts[panel["title"]] = n
            ax.set_title(panel["title"], fontsize=10.5, loc="left")
            ax.yaxis.set_major_formatter(_format_unit(panel["fieldConfig"]["defaults"].get("unit", "short")))
            ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            ax.set_xlim(datetime.fromtimestamp(start), datetime.fromtimestamp(end))
            if n == 0:
                ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes, color="grey")
            elif n <= 12:
                ax.legend(fontsize=7, loc="upper left", ncol=2 if n > 4 else 1, framealpha=0.7)
            else:
                ax.text(0.01, 0.97, f"{n} series", transform=ax.transAxes, fontsize=7, va="top")
            if row_title != last_row and c == 0:
                ax.annotate(row_title.upper(), xy=(0, 1.16), xycoords="axes fraction", fontsize=11,
                            fontweight="bold", color="#335")
        last_row = row_title
    with warnings.catch_warnings():
        # a panel with very long legend labels can make matplotlib give up on tight layout for
        # that figure; the PNG is still written (merely less tidy), so that is not an error
        warnings.filterwarnings("ignore", message="Tight layout not applied", category=UserWarning)
        fig.tight_layout(rect=(0, 0, 1, 0.985), h_pad=2.2)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--minutes", type=float, default=15.0, help="time range ending now")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes")
    args = parser.parse_args()
    end = time.time()
    counts = render(json.loads(args.dashboard.read_text()), args.prometheus, end - 60 * args.minutes, end,
                    args.out, args.rate_interval)
    for title, n in counts.items():
        print(f"{n:3d} series  {title}")


if __name__ == "__main__":
    main()
