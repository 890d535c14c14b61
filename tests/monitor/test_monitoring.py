"""The alert rules and the Grafana dashboard for `verify --textfile` (examples/monitoring, shipped in
the collection too): promtool checks the rules and runs their unit tests, and every metric they and the
dashboard name is one the real writer (vllm_ctxmgr/metrics.py) puts in a textfile, so a renamed metric
breaks this test instead of silently emptying a panel or muting an alert. No Prometheus runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import REPO
from tests.support.require import require
from vllm_ctxmgr.core.upgrade import CapacityMove
from vllm_ctxmgr.core.verdict import DEGRADED, Verification
from vllm_ctxmgr.monitor.metrics import write_textfile

SOURCE = REPO / "examples" / "monitoring"
COLLECTION_COPY = REPO / "ansible_collections" / "vllm" / "ctxmgr" / "monitoring"
RULES = SOURCE / "ctxmgr-alerts.yml"
RULE_TESTS = SOURCE / "ctxmgr-alerts.test.yml"
DASHBOARD = SOURCE / "ctxmgr-dashboard.json"
DEFAULT_PROMTOOL = Path("/var/cache/ctxmgr/promtool/promtool")  # the Makefile's PROMTOOL

# PromQL words that are not metric names; functions are told apart by the `(` that follows them
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
            "offset", "inf", "nan"}  # fmt: skip
# Grafana's own variables, which promtool does not know: what Grafana puts in their place
GRAFANA_VARIABLES = {"$instance": ".*", "$service": ".*", "$__rate_interval": "5m", "$__interval": "1m"}


def promtool() -> Path:
    """CTXMGR_PROMTOOL (the Makefile's), else one on the PATH, else where `make promtool` puts it;
    skipped where there is none, failed in CI (CTXMGR_REQUIRE_PROMTOOL=1)."""
    named = os.environ.get("CTXMGR_PROMTOOL")
    found = Path(named) if named else Path(shutil.which("promtool") or DEFAULT_PROMTOOL)
    missing = None if os.access(found, os.X_OK) else f"no promtool at {found} (make promtool)"
    require(missing, "promtool", required_by="CTXMGR_REQUIRE_PROMTOOL")
    return found


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool()), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def written_metric_names(tmp_path: Path) -> set[str]:
    """The series names the real writer puts in a textfile, read back with prometheus_client's parser;
    every optional figure is given, so no metric is left out for being unknown."""
    verification = Verification(
        service="vllm-glm5", result=DEGRADED, time=1_790_000_000.0, max_model_len=8192,
        planned_max_model_len=200_000, probe_latency_s=0.4, kv_cache_tokens=223_232,
        margin_bytes=-(1 << 30), unit={"n_restarts": 3}, duration_s=1.2,
        vllm_upgrade=CapacityMove("0.20.0", "0.21.0", 8192, 223_232, 133_939, 27.25, 16.35, 200_000,
                                  200_000, True, True).to_json(),
    )  # fmt: skip
    path = write_textfile(tmp_path / "vllm-glm5.prom", verification)
    families = list(text_string_to_metric_families(path.read_text()))
    names = {sample.name for family in families for sample in family.samples}
    assert len(names) == len(families)  # every declared family has its sample: none left out here
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers without label matchers, strings,
    ranges, grouping label lists, function names and keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+|ms|[smhdwy])?\b", " ", text)  # numbers, durations
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        following = text[match.end() :].lstrip()
        if match.group() in KEYWORDS or following.startswith("("):
            continue
        names.add(match.group())
    return names


def rule_exprs() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_exprs() -> dict[str, str]:
    return {
        f"{panel['title']} {target['refId']}": target["expr"]
        for panel in dashboard()["panels"]
        for target in panel["targets"]
    }


def test_the_expression_reader_finds_metrics_and_nothing_else() -> None:
    """The check below is only as good as this reader."""
    expr = (
        'max by (instance, service) (ctxmgr_verify_result{result="degraded", service=~"$service"} '
        "or 2e9 * rate(other_total[5m] offset 1h)) > bool on (service) group_left (x) up"
    )
    assert metric_names(expr) == {"ctxmgr_verify_result", "other_total", "up"}
    assert metric_names("time() - ctxmgr_verify_last_run_timestamp_seconds > 1800") == {
        "ctxmgr_verify_last_run_timestamp_seconds"
    }


def test_promtool_checks_the_rules() -> None:
    done = run_promtool("check", "rules", RULES.name, cwd=SOURCE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in done.stdout


def test_promtool_runs_the_rules_unit_tests() -> None:
    """ctxmgr-alerts.test.yml: input series as the textfile is scraped, and the alerts each rule must
    raise (labels and annotations) or not."""
    done = run_promtool("test", "rules", RULE_TESTS.name, cwd=SOURCE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_rules_unit_tests_cover_every_alert() -> None:
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == set(rule_exprs())


def test_the_rules_their_tests_and_the_dashboard_name_only_metrics_the_writer_writes(tmp_path: Path) -> None:
    written = written_metric_names(tmp_path)
    used = {f"rule {name}": metric_names(expr) for name, expr in rule_exprs().items()}
    used |= {f"panel {name}": metric_names(expr) for name, expr in panel_exprs().items()}
    used |= {
        f"rule test series {series['series']}": metric_names(series["series"])
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for series in test["input_series"]
    }
    assert all(names for names in used.values()), [where for where, names in used.items() if not names]
    unknown = {where: sorted(names - written) for where, names in used.items() if names - written}
    assert unknown == {}, f"not in the textfile ({sorted(written)}): {unknown}"
    on_panels = set().union(*(metric_names(expr) for expr in panel_exprs().values()))
    assert on_panels == written, f"metrics without a panel: {sorted(written - on_panels)}"


def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    """Each panel's query, with Grafana's variables as Grafana fills them, as a recording rule."""
    exprs = list(panel_exprs().values())
    for variable, value in GRAFANA_VARIABLES.items():
        exprs = [expr.replace(variable, value) for expr in exprs]
    assert not any("$" in expr for expr in exprs), exprs  # a variable this test does not know
    rules = {
        "groups": [
            {"name": "panels", "rules": [{"record": f"panel:{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(rules))
    done = run_promtool("check", "rules", "panels.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


def test_the_dashboard_picks_its_prometheus_and_every_panel_uses_it() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39  # Grafana 11
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    chosen = {"type": "prometheus", "uid": "${datasource}"}
    for panel in board["panels"]:
        assert panel["datasource"] == chosen, panel["title"]
        assert all(target["datasource"] == chosen for target in panel["targets"]), panel["title"]
        assert panel.get("description"), f"{panel['title']}: no description of what it shows"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for expr in panel_exprs().values():  # each query follows the host and service pickers
        assert all(f'{name}=~"${name}"' in expr for name in ("instance", "service")), expr


@pytest.mark.parametrize("name", sorted(p.name for p in SOURCE.iterdir()))
def test_the_collection_ships_the_same_files(name: str) -> None:
    """examples/monitoring is the source; the collection's copy must be it byte for byte."""
    copy = COLLECTION_COPY / name
    assert copy.exists() and copy.read_bytes() == (SOURCE / name).read_bytes(), (
        f"cp examples/monitoring/{name} {COLLECTION_COPY.relative_to(REPO)}/"
    )


def test_the_collection_ships_no_file_the_source_lacks() -> None:
    assert sorted(p.name for p in COLLECTION_COPY.iterdir()) == sorted(p.name for p in SOURCE.iterdir())


def test_every_source_path_the_monitoring_files_name_exists() -> None:
    """Issue 35: the alert rules named vllm_ctxmgr/metrics.py, a module that had moved to monitor/."""
    named = {
        path
        for file in sorted(SOURCE.iterdir())
        for path in re.findall(r"\b(?:vllm_ctxmgr|tests|benchmarks)/[\w/]+\.py\b", file.read_text())
    }
    assert "vllm_ctxmgr/monitor/metrics.py" in named
    assert [path for path in sorted(named) if not (REPO / path).is_file()] == []
