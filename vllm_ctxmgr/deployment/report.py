"""The operator's text of a deployment command, beside the one-service reports (report.py): a change's
verdict, then each node, then the diffs and the plan; a verification's verdict, then each node."""

from __future__ import annotations

from vllm_ctxmgr.deployment.coordinator import DeploymentVerdict
from vllm_ctxmgr.deployment.walk import DeploymentResult


def deployment_text(result: DeploymentResult) -> str:
    """The operator's report: the verdict first, then each node, then the diffs and the plan."""
    lines = [
        f"{result.deployment}: {result.action} {result.result}"
        + (
            f" (max_model_len {result.previous_max_model_len} -> {result.max_model_len})"
            if result.max_model_len
            else ""
        )
    ]
    if result.reason:
        lines.append(f"  {result.reason}")
    for node in result.nodes:
        stages = f", pipeline stage {','.join(map(str, node.stages))}" if node.stages else ""
        status = "" if node.ok else f": {node.reason}"
        lines.append(
            f"  node {node.node_rank} {node.host}:{node.service} ({node.role}{stages}) {node.step}{status}"
        )
    if result.suggestion:
        lines.append(f"  {result.suggestion}")
    if result.plan_text:
        lines += ["", result.plan_text.rstrip()]
    for node in result.nodes:
        if node.diff:
            lines += ["", f"--- node {node.node_rank} ({node.host}):", node.diff.rstrip()]
    return "\n".join(lines)


def verdict_text(verdict: DeploymentVerdict) -> str:
    """`deployment verify`'s report: the deployment's verdict, each node's, then why."""
    lines = [f"{verdict['deployment']}: {verdict['result']} (max_model_len {verdict['max_model_len']})"]
    for node in verdict["nodes"]:
        lines.append(f"  {node['host']}:{node['service']} ({node['role']}) {node['result']}")
    lines += [f"  {reason}" for reason in verdict["reasons"]]
    return "\n".join(lines)
