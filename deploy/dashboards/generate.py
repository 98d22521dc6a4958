"""Build the dashboards of panels.py with Grafana's foundation SDK and write them as JSON.

    python -m deploy.dashboards.generate        # or: tokenmux dashboard build

grafana-foundation-sdk (Grafana Labs' own typed builders, released with Grafana's schema)
is used rather than grafanalib: grafanalib's last release is from January 2024 and lags
the dashboard schema; the foundation SDK installs from PyPI here, covers every panel kind
Grafana has and its JSON is what Grafana itself produces. Panels sit two per row of a
24-column grid. The data source is a dashboard variable (`${datasource}`, any
Prometheus), so one JSON works in any Grafana.
"""
from __future__ import annotations

import json
from pathlib import Path

from deploy.dashboards.panels import DASHBOARDS, DashboardSpec, PanelSpec

OUT_DIR = Path(__file__).resolve().parent
PANEL_HEIGHT = 8
PANEL_WIDTH = 12


def build(spec: DashboardSpec) -> dict:
    """The dashboard's JSON model, as a dict."""
    from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import StackingMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (dashboard.Dashboard(spec.title).uid(spec.uid).description(spec.description)
             .tags(["tokenmux"]).refresh("10s").time("now-30m", "now").timezone("browser")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    for i, panel in enumerate(spec.panels):
        p = (timeseries.Panel().title(panel.title).unit(panel.unit).datasource(source)
             .height(PANEL_HEIGHT).span(PANEL_WIDTH)
             .grid_pos(GridPos(h=PANEL_HEIGHT, w=PANEL_WIDTH, x=PANEL_WIDTH * (i % 2),
                                         y=PANEL_HEIGHT * (i // 2))))
        description = panel.description + (" (NVML only: no data on virtual devices)" if panel.nvml_only else "")
        if description:
            p = p.description(description.strip())
        if panel.stacked:
            p = p.stacking(common.StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(30)
        for j, query in enumerate(panel.queries):
            p = p.with_target(prometheus.Dataquery().expr(query.expr).legend_format(query.legend)
                              .ref_id(chr(ord("A") + j)).datasource(source))
        board = board.with_panel(p)
    return json.loads(JSONEncoder(sort_keys=True, indent=1).encode(board.build()))


def render(spec: DashboardSpec) -> str:
    return json.dumps(build(spec), indent=1, sort_keys=True) + "\n"


def write_dashboards(out_dir: str | Path | None = None) -> list[Path]:
    out = Path(out_dir) if out_dir else OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in DASHBOARDS:
        path = out / f"{spec.uid.removeprefix('tokenmux-')}.json"
        path.write_text(render(spec))
        paths.append(path)
    return paths


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of a dashboard JSON."""
    return [(p["title"], t["expr"]) for p in board.get("panels", []) for t in p.get("targets", [])]


def find_panel(title: str) -> PanelSpec:
    for spec in DASHBOARDS:
        for panel in spec.panels:
            if panel.title == title:
                return panel
    raise KeyError(title)


if __name__ == "__main__":
    for written in write_dashboards():
        print(written)
