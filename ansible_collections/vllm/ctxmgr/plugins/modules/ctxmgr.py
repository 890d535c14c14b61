#!/usr/bin/python
# Copyright: vllm-ctxmgr contributors
# Apache License 2.0 (see LICENSE at the collection's root, or https://www.apache.org/licenses/LICENSE-2.0)
"""Drive the installed `ctxmgr --json` on the managed host: ctxmgr does the work, this module only
maps its one JSON object to Ansible's result (changed, check mode, diff mode, a failure message)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: ctxmgr
short_description: Change, roll back, verify or plan the context length of a vLLM systemd service
description:
  - Runs C(ctxmgr COMMAND --service SERVICE --json) on the managed host. ctxmgr plans with vLLM's own
    KV-cache accounting, edits the unit, restarts, follows the journal, probes the OpenAI endpoint and
    rolls back by itself when the start fails; this module reports what it did.
  - Check mode runs ctxmgr's dry run (C(--dry-run)) and reports C(changed) as "would change".
  - Diff mode returns the unit diff as ctxmgr printed it (API keys masked by ctxmgr).
version_added: "0.1.0"
options:
  command:
    description: What to run.
    type: str
    choices: [set-context, rollback, verify, plan, observe]
    default: set-context
  service:
    description: The systemd service that runs vLLM.
    type: str
    required: true
  context:
    description: The max_model_len to set (set-context) or plan (plan).
    type: int
  to:
    description: The revision to return to (rollback; default the previous good one).
    type: int
  gpu_memory_utilization:
    description: Use this utilisation instead of the planner's choice (set-context).
    type: float
  probe_tokens:
    description: max_tokens of ctxmgr's probe (set-context).
    type: int
  long_probe:
    description: Also prefill ~90% of the context when probing (set-context, verify).
    type: bool
    default: false
  force:
    description:
      - Apply a change the plan says will not fit, or cannot tell (exit 6); vLLM has the last word
        (set-context).
    type: bool
    default: false
  edit:
    description:
      - How set-context changes the unit. V(in-place) edits the file that holds C(ExecStart=).
      - V(dropin) leaves the unit file alone and writes C(ExecStart=) to C(UNIT.d/50-ctxmgr.conf), as
        C(systemctl edit) does; choose it where this collection or another template renders the unit,
        so the next converge keeps the change.
    type: str
    choices: [in-place, dropin]
    default: in-place
  timeout:
    description: Seconds a start may take (set-context, rollback).
    type: float
  wait_lock:
    description: Seconds to wait for another ctxmgr run on the service.
    type: float
  import_observation:
    description:
      - A file on the managed host holding C(ctxmgr observe --json) output from another host with the
        same GPU model and vLLM version. Before set-context it is stored with
        C(ctxmgr observe --service SERVICE --import FILE), so this host is planned from a real start.
    type: path
  observation:
    description:
      - The handed-over observation itself (another host's C(ctxmgr observe --json) output), for
        O(import_observation) to hold. It is written there first (the file mode 0600; a directory the
        module makes for it mode 0700, one that exists left as it is), so one task hands it over and
        imports it.
    type: dict
  observe_first:
    description:
      - First run C(ctxmgr observe --service SERVICE --json) and return it as RV(last_start), the
        service's last start (its GPU model and vLLM version) as it was before this task did anything.
      - A failure of it does not fail the task; RV(last_start.error) says what it was.
    type: bool
    default: false
  export_observation:
    description: After a set-context that applied, return C(ctxmgr observe --json) as C(observation).
    type: bool
    default: false
  extra_args:
    description: More ctxmgr flags, e.g. the planner's C(--gpu-memory 95.6GiB --gpu-count 8).
    type: list
    elements: str
    default: []
  state_dir:
    description: ctxmgr's state directory (C(--state-dir)); default ctxmgr's own (/var/lib/ctxmgr).
    type: path
  systemd_pid:
    description: Drive the systemd whose PID 1 is this host PID (C(--systemd-pid)).
    type: int
  ctxmgr_bin:
    description: The ctxmgr executable on the managed host.
    type: str
    default: ctxmgr
  nodes:
    description:
      - Every node of a multi-node vLLM deployment (vLLM's C(--nnodes)/C(--headless), or Ray) as
        C(HOST:UNIT), the head first. The module then runs on the head as the deployment's coordinator
        (C(ctxmgr deployment COMMAND --node ...)), reaching the other nodes over ssh, and changes, rolls
        back or verifies every node as one. Not for V(observe).
    type: list
    elements: str
    default: []
  ssh:
    description: The ssh command the head reaches the other nodes with, as words (with O(nodes)).
    type: list
    elements: str
    default: []
  remote_ctxmgr:
    description:
      - ctxmgr on the other nodes as words, with any of its own options (with O(nodes)), e.g.
        V([/opt/ctxmgr/bin/ctxmgr, --state-dir, /srv/ctxmgr]). Empty is C(ctxmgr) on their PATH.
    type: list
    elements: str
    default: []
notes:
  - Exit codes of ctxmgr are kept in C(exit_code); every non-zero one fails the task, with what happened
    on the host (rolled back and why, infeasible and the largest context that fits, locked, or a failed
    rollback that needs a human). Only C(verify)'s 1 with result C(degraded) passes (it serves); 70
    is ctxmgr's crash (an unexpected error) and always fails.
  - With O(nodes), every parameter one host's command takes (O(to), O(wait_lock), O(probe_tokens),
    O(long_probe)) is passed to C(ctxmgr deployment); O(probe_tokens) and O(long_probe) of C(set-context)
    go to the head's probe, O(long_probe) of C(verify) to the head's verify. An older ctxmgr whose
    deployment command does not take one refuses it by name and the task fails, never runs without it.
attributes:
  check_mode:
    description: Runs ctxmgr's dry run (C(--dry-run)); C(changed) then means "would change".
    support: full
  diff_mode:
    description: Returns the unit diff as ctxmgr printed it, API keys masked.
    support: full
author: vllm-ctxmgr contributors (!UNKNOWN)
"""

EXAMPLES = r"""
- name: 200K tokens of context, proven by ctxmgr's own probe
  vllm.ctxmgr.ctxmgr:
    service: vllm-glm5
    context: 200000

- name: A two-node deployment, changed as one by ctxmgr on its head
  vllm.ctxmgr.ctxmgr:
    service: vllm-glm5
    context: 200000
    nodes: ["gpu-a:vllm-glm5", "gpu-b:vllm-glm5"]

- name: What would change (no restart)
  vllm.ctxmgr.ctxmgr:
    service: vllm-glm5
    context: 200000
  check_mode: true
  diff: true
"""

RETURN = r"""
changed: {description: ctxmgr's C(changed); in check mode "would change", type: bool, returned: always}
result:
  description: unchanged | applied | dry-run | rolled-back | rollback-failed | infeasible
  type: str
  returned: always
exit_code: {description: ctxmgr's exit code, type: int, returned: always}
max_model_len: {description: the context the service has now (or would have), type: int, returned: when known}
previous_max_model_len: {description: the context before, type: int, returned: when known}
plan:
  description: the plan's figures (max_model_len, feasible, max_context, kv bytes)
  type: dict
  returned: when planned
decisive_line: {description: the journal line that decided a failed start, type: str, returned: always}
reason: {description: "why, in plain words", type: str, returned: always}
suggestion: {description: what to try, type: str, returned: always}
unit_diff: {description: the unit diff (keys masked), type: str, returned: always}
revision: {description: the revision ctxmgr recorded, type: int, returned: when a change was recorded}
rolled_back: {description: the change failed and ctxmgr restored the old unit, type: bool, returned: always}
observation:
  description: ctxmgr observe's output (observe; set-context with export_observation)
  type: dict
  returned: sometimes
last_start:
  description: With O(observe_first), the service's last start before this task.
  type: dict
  returned: when O(observe_first)
  contains:
    observation:
      description: ctxmgr observe's observation (GPU model, vLLM version, ...); empty where it failed.
      type: dict
      returned: always
    error:
      description: why ctxmgr observe failed, empty where it did not.
      type: str
      returned: always
ctxmgr: {description: ctxmgr's whole JSON object, type: dict, returned: always}
cmd: {description: the command line run, type: list, returned: always}
"""

import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import tempfile  # noqa: E402

try:  # the pure helpers below are unit-tested where Ansible is not installed
    from ansible.module_utils.basic import AnsibleModule
except ImportError:  # pragma: no cover
    AnsibleModule = None

EXIT_MEANINGS = {
    1: "failed (ctxmgr rolled the service back)",
    2: "usage error",
    3: "infeasible: the context does not fit",
    4: "locked by another ctxmgr run",
    5: "the change failed and its rollback failed too: the service needs a human",
    6: "the plan cannot decide (no memory information, or the weights unknown): nothing was changed",
    70: "ctxmgr crashed (an unexpected error, a bug): nothing was decided",
}
PLAN_FIGURES = (
    "max_model_len",
    "gpu_memory_utilization",
    "feasible",
    "max_context",
    "kv_bytes_per_gpu",
    "kv_bytes_per_token_per_gpu",
)


def base_argv(params: dict) -> list:
    argv = [params["ctxmgr_bin"]]
    if params.get("state_dir"):
        argv += ["--state-dir", params["state_dir"]]
    if params.get("systemd_pid"):
        argv += ["--systemd-pid", str(params["systemd_pid"])]
    return argv


def deployment_argv(params: dict, check_mode: bool) -> list:
    """`ctxmgr deployment COMMAND ... --node HOST:UNIT ...`: a multi-node deployment, run on its head."""
    command = params["command"]
    argv = [*base_argv(params), "deployment", command]
    if command in ("set-context", "plan"):
        argv.append(str(params["context"]))
    for node in params["nodes"]:
        argv += ["--node", node]
    if params.get("ssh"):
        argv += ["--ssh", " ".join(shlex.quote(word) for word in params["ssh"])]
    if params.get("remote_ctxmgr"):
        argv += ["--remote-ctxmgr", " ".join(shlex.quote(word) for word in params["remote_ctxmgr"])]
    if command in ("set-context", "plan") and params.get("gpu_memory_utilization") is not None:
        argv += ["--gpu-memory-utilization", str(params["gpu_memory_utilization"])]
    if command == "set-context":
        if params.get("probe_tokens") is not None:
            argv += ["--probe-tokens", str(params["probe_tokens"])]
        if params.get("force"):
            argv.append("--force")
        if params.get("edit") == "dropin":
            argv += ["--edit", "dropin"]
    # every parameter one host's command takes goes to the deployment's too: a ctxmgr whose deployment
    # command lacks one refuses it by name, rather than `rollback, to: 3` quietly going elsewhere
    if command == "rollback" and params.get("to") is not None:
        argv += ["--to", str(params["to"])]
    if command in ("set-context", "verify") and params.get("long_probe"):
        argv.append("--long-probe")
    if command in ("set-context", "rollback"):
        if params.get("timeout") is not None:
            argv += ["--timeout", str(params["timeout"])]
        if params.get("wait_lock") is not None:
            argv += ["--wait-lock", str(params["wait_lock"])]
        argv.append("--dry-run" if check_mode else "--yes")
    if command in ("set-context", "plan"):
        argv += list(params.get("extra_args") or [])
    return [*argv, "--json"]


def command_argv(params: dict, check_mode: bool) -> list:
    if params.get("nodes"):
        return deployment_argv(params, check_mode)
    command, service = params["command"], params["service"]
    argv = [*base_argv(params), command]
    if command == "plan":
        argv += [str(params["context"]), "--service", service]
    else:
        argv += ["--service", service]
    if command == "observe" and check_mode:
        argv.append("--dry-run")  # check mode writes nothing: no observation stored, no lock taken
    if command == "set-context":
        argv.insert(len(base_argv(params)) + 1, str(params["context"]))
        if params.get("gpu_memory_utilization") is not None:
            argv += ["--gpu-memory-utilization", str(params["gpu_memory_utilization"])]
        if params.get("probe_tokens") is not None:
            argv += ["--probe-tokens", str(params["probe_tokens"])]
        if params.get("force"):
            argv.append("--force")
        if params.get("edit") == "dropin":
            argv += ["--edit", "dropin"]
    if command == "rollback" and params.get("to") is not None:
        argv += ["--to", str(params["to"])]
    if command in ("set-context", "verify") and params.get("long_probe"):
        argv.append("--long-probe")
    if command in ("set-context", "rollback"):
        if params.get("timeout") is not None:
            argv += ["--timeout", str(params["timeout"])]
        if params.get("wait_lock") is not None:
            argv += ["--wait-lock", str(params["wait_lock"])]
        argv.append("--dry-run" if check_mode else "--yes")
    if command in ("set-context", "plan"):
        argv += list(params.get("extra_args") or [])
    return [*argv, "--json"]


def parse_output(rc: int, stdout: str, stderr: str) -> dict:
    """ctxmgr's one JSON object; an error that printed only a line on stderr becomes {"error": ...}."""
    text = stdout.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict):
            data.setdefault("exit_code", rc)
            return data
    message = " ".join(stderr.strip().splitlines()[-3:]) or text or "no output"
    return {"error": message.removeprefix("error: "), "exit_code": rc}


def import_unsupported(data: dict) -> bool:
    """ctxmgr before `observe --import` answers a usage error naming the option."""
    error = str(data.get("error") or "").lower()
    return data.get("exit_code") == 2 and "--import" in error and "no such option" in error


def would_change(data: dict) -> bool:
    """A dry run's verdict: ctxmgr's `changed` where it marks dry runs, else a non-empty diff."""
    if data.get("dry_run") is True:
        return bool(data.get("changed"))
    return data.get("result") == "dry-run" and bool((data.get("diff") or "").strip())


def failure_message(params: dict, data: dict) -> str:
    code = int(data.get("exit_code") or 1)
    what = f"ctxmgr {params['command']}"
    if params["command"] in ("set-context", "plan") and params.get("context"):
        what += f" {params['context']}"
    what += f" on {params['service']}"
    if data.get("error"):
        return f"{what}: {data['error']} (exit {code}: {EXIT_MEANINGS.get(code, 'error')})"
    parts = [f"{what}: {data.get('result') or EXIT_MEANINGS.get(code, 'failed')} (exit {code})"]
    if data.get("reason"):
        parts.append(data["reason"])
    if data.get("decisive_line"):
        parts.append(f"vLLM said: {data['decisive_line']}")
    if code == 1 and data.get("result") == "rolled-back":
        old = data.get("previous_max_model_len")
        parts.append(f"the previous unit is back{f' (max_model_len {old})' if old else ''}")
    if data.get("suggestion"):
        parts.append(f"try: {data['suggestion']}")
    return "; ".join(parts)


def passes(command: str, data: dict) -> bool:
    """Exit 0; for verify also 1, "degraded" (it serves), where ctxmgr's JSON says degraded: a crash
    (70; 1 from a ctxmgr before 70 had its own code) or any other code is no verdict and fails."""
    code = data.get("exit_code")
    if code == 0 and data.get("result") != "error":
        return True
    return command == "verify" and code == 1 and data.get("result") == "degraded"


def changed_though_failed(code: int, data: dict) -> bool:
    """A failure leaves nothing changed, except where ctxmgr could not roll back (exit 5) or a
    deployment change served on every node but a node did not record it final (result "applied",
    exit 1: its units are the new ones)."""
    return code == 5 or (data.get("result") == "applied" and bool(data.get("changed")))


def summary(params: dict, data: dict, check_mode: bool) -> dict:
    plan = data.get("plan") or {}
    result = {
        "result": data.get("result") or "",
        "exit_code": int(data.get("exit_code") or 0),
        "max_model_len": data.get("max_model_len"),
        "previous_max_model_len": data.get("previous_max_model_len"),
        "plan": {k: plan[k] for k in PLAN_FIGURES if k in plan},
        "decisive_line": data.get("decisive_line") or "",
        "reason": data.get("reason") or data.get("error") or "",
        "suggestion": data.get("suggestion") or "",
        "unit_diff": data.get("diff") or "",
        "revision": data.get("revision"),
        "rolled_back": data.get("result") == "rolled-back",
        "ctxmgr": data,
    }
    if params["command"] == "plan":
        result["plan"] = {k: data[k] for k in PLAN_FIGURES if k in data}
        result["max_model_len"] = data.get("max_model_len")
    if params["command"] in ("set-context", "rollback"):
        result["changed"] = would_change(data) if check_mode else bool(data.get("changed"))
    else:
        result["changed"] = False
    return result


def observe_argv(params: dict, check_mode: bool) -> list:
    """observe_first's `ctxmgr observe`: read only in check mode (--dry-run stores nothing)."""
    argv = [*base_argv(params), "observe", "--service", params["service"], "--json"]
    return [*argv, "--dry-run"] if check_mode else argv


def write_observation(path: str, observation: dict) -> None:
    """Another host's observation where `observe --import` reads it: the file 0600, replaced whole (a
    reader never sees half of it). The directories it has to make are made 0700; one that exists is the
    operator's and is left as it is (a 1777 /tmp keeps its sticky bit; a link is not followed to chmod
    what it points at)."""
    directory = os.path.dirname(path) or "."
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    for made in reversed(missing):
        os.mkdir(made, 0o700)  # its own: only its owner enters it (mkdir's mode is cut by the umask)
    directory = os.path.dirname(path) or "."
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".observation-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(observation, indent=4, sort_keys=True) + "\n")
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def last_start(params: dict, data: dict) -> dict:
    """observe_first's answer: the observation, or why ctxmgr observe gave none."""
    if passes("observe", data):
        return {"observation": data.get("observation") or {}, "error": ""}
    return {"observation": {}, "error": failure_message({**params, "command": "observe"}, data)}


def run_json(module: AnsibleModule, argv: list) -> dict:
    rc, stdout, stderr = module.run_command(argv, check_rc=False)
    return parse_output(rc, stdout, stderr)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "command": {
                "type": "str",
                "default": "set-context",
                "choices": ["set-context", "rollback", "verify", "plan", "observe"],
            },
            "service": {"type": "str", "required": True},
            "context": {"type": "int"},
            "to": {"type": "int"},
            "gpu_memory_utilization": {"type": "float"},
            "probe_tokens": {"type": "int", "no_log": False},  # a token count, not a secret token
            "long_probe": {"type": "bool", "default": False},
            "force": {"type": "bool", "default": False},
            "edit": {"type": "str", "default": "in-place", "choices": ["in-place", "dropin"]},
            "timeout": {"type": "float"},
            "wait_lock": {"type": "float"},
            "import_observation": {"type": "path"},
            "observation": {"type": "dict"},
            "observe_first": {"type": "bool", "default": False},
            "export_observation": {"type": "bool", "default": False},
            "extra_args": {"type": "list", "elements": "str", "default": []},
            "state_dir": {"type": "path"},
            "systemd_pid": {"type": "int"},
            "ctxmgr_bin": {"type": "str", "default": "ctxmgr"},
            "nodes": {"type": "list", "elements": "str", "default": []},
            "ssh": {"type": "list", "elements": "str", "default": []},
            "remote_ctxmgr": {"type": "list", "elements": "str", "default": []},
        },
        required_if=[("command", "set-context", ["context"]), ("command", "plan", ["context"])],
        supports_check_mode=True,
    )
    params, check_mode = module.params, module.check_mode
    extra: dict = {}
    if params["nodes"] and (
        params["command"] == "observe" or params["import_observation"] or params["observe_first"]
    ):
        module.fail_json(msg="observe and import_observation are one host's: not with nodes", changed=False)
    if params["observation"] is not None and not params["import_observation"]:
        module.fail_json(msg="observation is written to import_observation: name that file", changed=False)

    if params["observe_first"]:
        observed = run_json(module, observe_argv(params, check_mode))
        extra["last_start"] = last_start(params, observed)

    if params["import_observation"] and params["command"] == "set-context":
        # stored before the plan, so this host is planned from the first host's real start
        argv = [*base_argv(params), "observe", "--service", params["service"],
                "--import", params["import_observation"], "--json"]  # fmt: skip
        if check_mode:
            extra["imported_observation"] = "skipped in check mode"
        else:
            if params["observation"] is not None:
                try:
                    write_observation(params["import_observation"], params["observation"])
                except OSError as exc:
                    module.fail_json(msg=f"writing {params['import_observation']}: {exc}", changed=False)
            imported = run_json(module, argv)
            if import_unsupported(imported):
                # an older ctxmgr: this host is planned from estimates (and calibrated by its own start)
                extra["imported_observation"] = "unsupported: this ctxmgr's observe has no --import"
                module.warn(
                    f"{params['ctxmgr_bin']} observe has no --import: planned without the handed-over start"
                )
            elif imported.get("exit_code"):
                why = imported.get("error") or imported.get("reason") or "failed"
                data = {**imported, "error": f"importing {params['import_observation']}: {why}"}
                message = failure_message({**params, "command": "observe"}, data)
                module.fail_json(
                    msg=message, cmd=argv, changed=False, ctxmgr=imported, exit_code=imported.get("exit_code")
                )
            else:
                extra["imported_observation"] = params["import_observation"]

    argv = command_argv(params, check_mode)
    data = run_json(module, argv)
    result = summary(params, data, check_mode)
    result.update(extra, cmd=argv)
    if params["command"] == "observe":
        result["observation"] = data.get("observation", {})
    if module._diff and result["unit_diff"]:
        result["diff"] = {"prepared": result["unit_diff"]}

    code = result["exit_code"]
    if not passes(params["command"], data):
        result["changed"] = changed_though_failed(code, data)
        module.fail_json(msg=failure_message(params, data), **result)

    one_host_change = params["command"] == "set-context" and not params["nodes"]
    if params["export_observation"] and not check_mode and one_host_change:
        observed = run_json(module, [*base_argv(params), "observe", "--service", params["service"], "--json"])
        result["observation"] = observed if not observed.get("exit_code") else {}
        if observed.get("exit_code"):
            module.warn(f"ctxmgr observe after the change failed: {observed.get('error')}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
