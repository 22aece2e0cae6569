"""The Grafana dashboard is provisioning-ready and has the panels operators asked for."""
import json

import yaml

from conftest import GRAFANA

DASHBOARD = json.loads((GRAFANA / "dashboards" / "wprepd.json").read_text())


def test_dashboard_is_provisioning_ready():
    assert DASHBOARD["uid"] == "wprepd" and "id" not in DASHBOARD
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "wprep.yaml").read_text())
    assert prov["apiVersion"] == 1 and prov["providers"][0]["type"] == "file"
    # Every query names its data source through the dashboard's variable.
    for p in DASHBOARD["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert 'job="wprepd"' in t["expr"] and 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])


def test_dashboard_has_the_panels_and_variables_asked_for():
    titles = {p["title"] for p in DASHBOARD["panels"]}
    for want in ("Request rate by status code and layout", "Latency p50 / p90 / p99", "Kernel time per GPU",
                 "Peak extra device bytes against output bytes", "GB/s per GPU", "In-flight work",
                 "IPC cache", "Warm devices"):
        assert want in titles, want
    names = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert {"instance", "gpu"} <= names
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    gpu_panels = [p for p in DASHBOARD["panels"] if "GPU" in p["title"]]
    for p in gpu_panels:
        for t in p["targets"]:
            assert 'device=~"$gpu"' in t["expr"], (p["title"], t["expr"])
