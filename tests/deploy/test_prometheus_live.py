"""A real Prometheus scraping a real wprepd: the daemon started from the rendered DaemonSet
(CPU engine where there is no GPU), traffic driven with the CLI, then every recording rule
and every dashboard query evaluated through Prometheus' HTTP API, each result required to
be there and plausible, and finally the daemon stopped until WprepdDown goes pending."""
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from conftest import (GRAFANA, IMAGE_PREFIX, PROM, RenderedDaemon, flag_value, image_env, need_sandbox,
                      require_flags_for, wprepd_help)
from pending import pending_in

PROM_ADDR = "127.0.0.1:9090"
CLIENT_UID = 1000
# (layout, direction, shape, input bytes): what the traffic converts.
TRAFFIC = [("hopper_value", "swizzle", "256,256", 32768),
           ("blackwell_shuffled_value", "swizzle", "256,256", 32768),
           ("hopper_value", "unswizzle", "256,256", 32768)]
TRAFFIC_SECONDS = 8


class Live:
    pass


def bytes_value(v):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(v[:-1]) * units[v[-1].upper()] if v[-1].upper() in units else int(v)


def default_of(flag):
    """A flag's default as `wprepd --help` states it: "(default 1G)"."""
    text = wprepd_help()
    # The flag's own entry (its line, indented two spaces), not another flag's help naming it.
    m = re.search(r"^  " + re.escape(flag) + r"\b[^\n]*(?:\n\s{20,}[^\n]*)*?\(default ([^)\s;]+)\)", text,
                  re.M)
    assert m, f"wprepd --help states no default for {flag}"
    return m.group(1)


def api(path, **params):
    url = f"http://{PROM_ADDR}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def query(expr):
    data = api("/api/v1/query", query=expr)
    assert data["resultType"] == "vector", data
    return [(s["metric"], float(s["value"][1])) for s in data["result"]]


def xfail_if_pending(expr):
    """An expected failure while a metric the expression needs is pending; a failure once the
    daemon exports it and it is still listed as pending."""
    missing = pending_in(expr)
    landed = [m for m in missing if query(f'count({{__name__="{m}"}})')]
    if landed:
        pytest.fail(f"{', '.join(landed)} exported now: remove from PENDING_METRICS (tests/deploy/pending.py)")
    if missing:
        pytest.xfail(f"needs pending metric(s) {', '.join(missing)} (tests/deploy/pending.py)")


@pytest.fixture(scope="module")
def live():
    need_sandbox()
    require_flags_for("daemonset")
    lv = Live()
    lv.daemon = d = RenderedDaemon("daemonset").start()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="wprep-prom-"))
    lv.prom = None
    try:
        st = d.container["startupProbe"]
        d.wait_probe(st, min(st["periodSeconds"] * st["failureThreshold"], 120))
        lv.metrics = flag_value(d.cmd, "--metrics-address")
        lv.max_buffered_bytes = bytes_value(flag_value(d.cmd, "--max-buffered-bytes") or default_of("--max-buffered-bytes"))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in sorted((PROM / "rules").glob("*.yml"))],
            "scrape_configs": [{"job_name": "wprepd", "static_configs": [{"targets": [lv.metrics]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        check = subprocess.run(["promtool", "check", "config", str(tmp / "prometheus.yml")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        lv.prom_log = open(tmp / "prometheus.log", "w+")
        lv.prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address={PROM_ADDR}"],
                                   stdout=lv.prom_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert lv.prom.poll() is None, (tmp / "prometheus.log").read_text()
            try:
                if [v for _, v in query('up{job="wprepd"}')] == [1.0]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape wprepd:\n" + (tmp / "prometheus.log").read_text()
            time.sleep(0.2)

        # Traffic through the Unix socket, as a client pod in the daemon's group.
        sock = flag_value(d.cmd, "--listen")
        os.chmod(tmp, 0o777)
        lv.ok_requests, lv.bad_requests, lv.output_bytes = {}, 0, 0
        lv.traffic_start = time.time()
        end = time.monotonic() + TRAFFIC_SECONDS
        i = 0
        while time.monotonic() < end:
            layout, direction, shape, nbytes = TRAFFIC[i % len(TRAFFIC)]
            inp = tmp / f"in{i % 2}.bin"
            inp.write_bytes(os.urandom(nbytes))
            cmd = [str(IMAGE_PREFIX / "bin" / "wprep"), "convert", "--target", sock, "--layout", layout,
                   "--direction", direction, "--shape", shape, "--input", str(inp), "--output", str(tmp / "out.bin")]
            if i % 5 == 4:  # a client mistake: INVALID_ARGUMENT, which is not a server error
                cmd[cmd.index(shape)] = "256,3"
            r = subprocess.run(["setpriv", f"--reuid={CLIENT_UID}", f"--regid={CLIENT_UID}",
                                f"--groups={d.gid}", "--"] + cmd, env=image_env(), capture_output=True, text=True)
            if i % 5 == 4:
                assert r.returncode == 2 and r.stderr.startswith("INVALID_ARGUMENT"), r.stderr
                lv.bad_requests += 1
            else:
                assert r.returncode == 0, r.stderr
                lv.ok_requests[layout] = lv.ok_requests.get(layout, 0) + 1
                lv.output_bytes += int(re.search(r"output_bytes (\d+)", r.stdout).group(1))
            i += 1
        lv.traffic_seconds = time.time() - lv.traffic_start
        # The request log: every request's seconds, for the range the quantiles must fall in.
        lv.seconds = [float(m) for m in re.findall(r"event=request .*?seconds=([0-9.e-]+)", d.log_text())]
        assert len(lv.seconds) == sum(lv.ok_requests.values()) + lv.bad_requests
        time.sleep(3)  # a few more scrapes and rule evaluations
        lv.buckets = sorted({float(m["le"]) for m, _ in query('wprep_request_duration_seconds_bucket{method="ConvertStream"}')})
        yield lv
    finally:
        d.close()
        if lv.prom is not None:
            lv.prom.terminate()
            lv.prom.wait(30)
        subprocess.run(["rm", "-rf", str(tmp)])


def in_observed_range(lv, q):
    """A histogram quantile lies between the bucket edges around the observed durations."""
    lo = max([b for b in lv.buckets if b <= min(lv.seconds)], default=0.0)
    hi = min([b for b in lv.buckets if b >= max(lv.seconds)], default=math.inf)
    return lo <= q <= hi


def by(results, **labels):
    return [v for m, v in results if all(m.get(k) == x for k, x in labels.items())]


# -- recording rules --------------------------------------------------------------------

def rules():
    out = []
    for f in sorted((PROM / "rules").glob("*.yml")):
        for g in yaml.safe_load(f.read_text())["groups"]:
            out += [r for r in g["rules"] if "record" in r]
    return out


def check_rule(lv, name, res):
    layouts = set(lv.ok_requests)
    if name == "instance:wprep_requests:rate5m":
        assert by(res, instance=lv.metrics)[0] > 0
    elif name == "instance_code_layout:wprep_requests:rate5m":
        for layout in layouts:
            assert by(res, code="OK", layout=layout)[0] > 0, layout
        assert sum(by(res, code="INVALID_ARGUMENT")) > 0
    elif name == "instance:wprep_request_errors:ratio_rate5m":
        assert by(res, instance=lv.metrics) == [0.0], "client mistakes are not server errors"
    elif name.startswith("instance_method:wprep_request_duration_seconds:p"):
        (q,) = by(res, method="ConvertStream")
        assert in_observed_range(lv, q), (q, min(lv.seconds), max(lv.seconds))
        assert all(math.isnan(v) for m, v in res if m["method"] != "ConvertStream"), "no other method ran"
    elif name == "instance_device:wprep_kernel_duration_seconds:rate5m":
        (busy,) = by(res, device="cpu")
        assert 0 < busy < 1
    elif name == "instance_device:wprep_converted_bytes:rate5m":
        (rate,) = by(res, device="cpu")
        assert 0.5 < rate * 300 / lv.output_bytes < 1.5, (rate, lv.output_bytes)
    elif name == "instance_transport:wprep_request_peak_extra_device_bytes:p99_rate5m":
        (stream,) = by(res, transport="stream")
        assert stream == 0, "the CPU engine allocates no device memory"
    elif name == "instance:wprep_ipc_cache_lookups:rate5m":
        assert by(res, instance=lv.metrics) == [0.0], "no IPC traffic on the CPU engine"
    elif name == "instance:wprep_ipc_cache_misses:ratio_rate5m":
        (ratio,) = by(res, instance=lv.metrics)
        assert math.isnan(ratio), "0 misses of 0 lookups"
    elif name == "instance_device:wprep_device_memory_waits:rate5m":
        assert by(res, device="cpu") == [0.0]
    else:
        pytest.fail(f"recording rule {name} has no plausibility check here: add one")


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["record"])
def test_recording_rule(live, rule):
    xfail_if_pending(rule["expr"])
    direct = query(rule["expr"])
    assert direct, f"{rule['record']}: its expression returned nothing"
    check_rule(live, rule["record"], direct)
    recorded = query(rule["record"])
    assert recorded, f"{rule['record']}: Prometheus has not recorded it"
    check_rule(live, rule["record"], recorded)


# -- dashboard --------------------------------------------------------------------------

DASHBOARD = json.loads((GRAFANA / "dashboards" / "wprepd.json").read_text())


def grafana_expr(expr, lv=None):
    """A panel query as Grafana sends it: the variables at All, the rate interval set."""
    return (expr.replace("$__rate_interval", "30s").replace('"$instance"', '".*"')
            .replace('"$gpu"', '".*"'))


def targets():
    return [(p["title"], t) for p in DASHBOARD["panels"] for t in p.get("targets", [])]


def check_panel(lv, title, legend, res):
    if title == "Daemons up":
        assert [v for _, v in res] == [1.0]
    elif title == "SERVING":
        assert [v for _, v in res] == [1.0]
    elif title == "Warm devices":
        assert by(res, device="cpu") == [1.0]
    elif title == "Build":
        (m, v), = res
        assert v == 1 and m["version"] and m["cuda"] in ("true", "false")
    elif title == "Request rate by status code and layout":
        for layout in lv.ok_requests:
            assert by(res, code="OK", layout=layout)[0] > 0
    elif title.startswith("Latency"):
        (q,) = by(res, method="ConvertStream")
        assert in_observed_range(lv, q), (legend, q)
    elif title == "Kernel time per GPU":
        (v,) = by(res, device="cpu")
        assert v > 0
        if "s/request" in legend:
            assert v <= max(lv.seconds), "engine time is part of the request time"
    elif title == "GB/s per GPU":
        (v,) = by(res, device="cpu")
        assert v > 0
    elif title == "Peak extra device bytes against output bytes":
        if "output" in legend:
            (v,) = [v for _, v in res]
            per_conversion = lv.output_bytes / sum(lv.ok_requests.values())
            assert 0.5 < v / per_conversion < 2, (v, per_conversion)
        else:
            assert by(res, transport="stream") == [0.0]
    elif title == "Device memory":
        assert by(res, device="cpu") == [0.0], "the CPU engine holds no device memory, and no budget applies to it"
    elif title == "In-flight work":
        assert by(res, device="cpu") == [0.0], "the traffic has finished"
    elif title == "Host buffers":
        (v,) = [v for _, v in res]
        if "budget" in legend:
            assert v == lv.max_buffered_bytes, (v, lv.max_buffered_bytes)
        else:
            assert v == 0, "every call has ended, so nothing stays buffered"
    elif title == "Host memory queue":
        if "waiting" in legend:
            assert [v for _, v in res] == [0.0], "the traffic has finished, so nothing waits"
        else:
            assert {m["reason"] for m, _ in res} == {"timeout", "too_large", "queue_full", "cancelled"}
            assert all(v == 0 for _, v in res), "the light traffic never waited past its bound"
    elif title == "Host memory wait p50 / p99":
        # The traffic's calls found host memory free (0 s) or waited less than a request took;
        # NaN once no call came within the rate window.
        assert all(math.isnan(v) or 0 <= v <= max(lv.seconds) for _, v in res), res
    elif title == "Refused connections":
        assert [v for _, v in res] == [0.0]
    elif title == "IPC cache":
        assert [v for _, v in res] == [0.0], "no IPC traffic on the CPU engine"
    else:
        pytest.fail(f"panel {title!r} has no plausibility check here: add one")


@pytest.mark.parametrize("title,target", targets(), ids=[f"{t}/{x['refId']}" for t, x in targets()])
def test_dashboard_query(live, title, target):
    xfail_if_pending(target["expr"])
    res = query(grafana_expr(target["expr"]))
    assert res, f"{title} {target['legendFormat']}: no result for {grafana_expr(target['expr'])}"
    check_panel(live, title, target["legendFormat"], res)


def test_dashboard_variables(live):
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert set(variables) == {"datasource", "instance", "gpu"}
    for name, want in (("instance", live.metrics), ("gpu", "cpu")):
        q = variables[name]["query"]["query"]
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", q)
        series = api("/api/v1/series", **{"match[]": grafana_expr(m.group(1))})
        assert want in {s[m.group(2)] for s in series}, (name, series)


# -- an alert ---------------------------------------------------------------------------

def test_down_alert_fires_when_the_daemon_stops(live):
    assert live.daemon.stop(signal.SIGTERM) == 0
    deadline = time.monotonic() + 30
    while True:
        alerts = [a for a in api("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == "WprepdDown"]
        if alerts:
            break
        assert time.monotonic() < deadline, "WprepdDown did not go pending"
        time.sleep(0.5)
    (a,) = alerts
    assert a["state"] in ("pending", "firing") and a["labels"]["instance"] == live.metrics, a
