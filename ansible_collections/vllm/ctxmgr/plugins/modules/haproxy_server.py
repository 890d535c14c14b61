#!/usr/bin/python
# Copyright: vllm-ctxmgr contributors
# Apache License 2.0 (see LICENSE at the collection's root, or https://www.apache.org/licenses/LICENSE-2.0)
"""Drain / undrain one HAProxy server through the runtime API and wait until it is idle or UP."""

from __future__ import annotations

DOCUMENTATION = r"""
module: haproxy_server
short_description: Drain or undrain an HAProxy server and wait until it is idle or UP
description:
  - Talks to HAProxy's runtime API (the C(stats socket ... level admin)), a unix socket path or host:port.
  - C(state=drain) takes no new requests (the ones in flight go on); with C(wait=idle) the task returns
    once the server has no session in flight and none queued. C(state=ready) puts it back; with
    C(wait=up) the task returns once HAProxy's own health checks say UP, i.e. it takes traffic again.
  - Run it where the socket is reachable (usually C(delegate_to) the load balancer or the controller).
version_added: "0.1.0"
options:
  socket:
    description: The runtime API, C(/run/haproxy/admin.sock) or C(127.0.0.1:9999).
    type: str
    required: true
  backend:
    description: The backend that holds the server.
    type: str
    required: true
  server:
    description: The server's name in that backend.
    type: str
    required: true
  state:
    description: The admin state to set; C(present) sets nothing (only waits / reports).
    type: str
    choices: [drain, ready, maint, present]
    default: present
  wait:
    description: What to wait for after setting the state.
    type: str
    choices: [none, idle, up]
    default: none
  timeout:
    description: Seconds to wait.
    type: float
    default: 120
attributes:
  check_mode:
    description: Sets nothing and waits for nothing; C(changed) says whether the admin state would change.
    support: full
author: vllm-ctxmgr contributors (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Out of rotation, and wait until its last request is done
  vllm.ctxmgr.haproxy_server:
    socket: /run/haproxy/admin.sock
    backend: vllm
    server: gpu-node-1
    state: drain
    wait: idle
  delegate_to: lb1
"""

RETURN = r"""
status: {description: "HAProxy's status after the task: UP, DRAIN, DOWN, MAINT", type: str, returned: always}
admin_state_before:
  description: "the admin state before the task: ready, drain or maint"
  type: str
  returned: always
in_flight: {description: sessions in flight (scur), type: int, returned: always}
waited_s: {description: seconds spent waiting, type: float, returned: always}
"""

import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import HaproxyError, Runtime  # noqa: E402


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "socket": {"type": "str", "required": True},
            "backend": {"type": "str", "required": True},
            "server": {"type": "str", "required": True},
            "state": {"type": "str", "default": "present", "choices": ["drain", "ready", "maint", "present"]},
            "wait": {"type": "str", "default": "none", "choices": ["none", "idle", "up"]},
            "timeout": {"type": "float", "default": 120.0},
        },
        supports_check_mode=True,
    )
    p = module.params
    runtime = Runtime(p["socket"])
    began = time.monotonic()
    try:
        before = runtime.admin_state(p["backend"], p["server"])
        changed = p["state"] != "present" and before != p["state"]
        if changed and not module.check_mode:
            runtime.set_state(p["backend"], p["server"], p["state"])
        row = runtime.server(p["backend"], p["server"])
        if p["wait"] != "none" and not module.check_mode:
            row = runtime.wait(p["backend"], p["server"], p["wait"], p["timeout"])
    except HaproxyError as exc:
        module.fail_json(msg=f"{p['backend']}/{p['server']}: {exc}", changed=False)
    module.exit_json(
        changed=changed,
        admin_state_before=before,
        status=row.get("status", ""),
        in_flight=int(row.get("scur") or 0),
        waited_s=round(time.monotonic() - began, 2),
    )


if __name__ == "__main__":
    main()
