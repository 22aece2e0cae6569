"""promtool on the shipped Prometheus files: the scrape config, the rule files, and the
rules' unit tests (deploy/prometheus/tests)."""
import subprocess

from conftest import PROM


def promtool(*args):
    r = subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_check_config():
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS: 2 rule files found" in out, out


def test_check_rules():
    promtool("check", "rules", *sorted(str(p.relative_to(PROM)) for p in (PROM / "rules").glob("*.yml")))


def test_rule_unit_tests():
    tests = sorted(str(p.relative_to(PROM)) for p in (PROM / "tests").glob("*.yml"))
    assert tests
    out = promtool("test", "rules", *tests)
    assert "SUCCESS" in out, out


def test_every_alert_has_a_unit_test():
    import yaml
    alerts = {r["alert"] for f in (PROM / "rules").glob("*.yml")
              for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for f in (PROM / "tests").glob("*.yml")
              for case in yaml.safe_load(f.read_text())["tests"] for t in case.get("alert_rule_test", [])
              if t.get("exp_alerts")}
    assert alerts == tested, f"alerts without a firing unit test: {sorted(alerts - tested)}"
    wanted = {"WprepdDown", "WprepdNotServing", "WprepdHighErrorRatio", "WprepdHighLatencyP99",
              "WprepdPeakDeviceBytesNearBudget", "WprepdIpcCacheThrash", "WprepdRequestsWaitingForMemory",
              "WprepdHostMemoryRefusals"}
    assert wanted <= alerts, sorted(wanted - alerts)
