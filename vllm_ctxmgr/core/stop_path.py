"""What a stop of the unit may leave holding its GPUs, and who holds them after it. PURE.

A restart is a stop and a start. Where the stop does not end every process of the old vLLM, the start
meets GPUs still full, fails vLLM's free-memory check, and the change reads it as the new
configuration's fault:

- KillMode=process or none: systemd signals only the main process (process) or none (none), so the
  API server's children, EngineCore and the TP workers (vLLM #55510: they outlive a dead API server)
  stay, with their CUDA memory (systemd.kill(5));
- `docker run` / `podman run` in ExecStart= without ExecStop=: systemd stops the client; the container
  and vLLM in it outlive it, and the SIGKILL after TimeoutStopSec reaches the client only;
- vLLM's --shutdown-timeout (0.18+, default 0: vllm/config/vllm.py:L454) drains in-flight requests for
  up to that many seconds after SIGTERM (v1/engine/core.py:L1709-L1736); a TimeoutStopSec not above
  it makes systemd SIGKILL the drain.

`StopPath.risks` says which of these the unit has, before a restart; `gpu_holders` names the
processes of the old instance still on the service's GPUs after the stop.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from vllm_ctxmgr.core.hardware import GpuState, gib

KILL_MODES_LEAVING_CHILDREN = ("process", "none")


@dataclass(frozen=True)
class StopPath:
    """How systemd stops the unit (its KillMode=, TimeoutStopSec=, ExecStop=) and what vLLM does on
    SIGTERM (--shutdown-timeout)."""

    unit: str
    kill_mode: str  # control-group (systemd's default) | mixed | process | none
    timeout_stop_s: float | None  # None: infinity (systemd never escalates to SIGKILL)
    has_exec_stop: bool
    container: str | None = None  # "docker" | "podman" where ExecStart= runs the container client
    shutdown_timeout_s: int | None = None  # vLLM's --shutdown-timeout where the unit gives one

    def risks(self) -> list[str]:
        """One line per way the stop could leave something holding the GPUs."""
        found = []
        if self.kill_mode in KILL_MODES_LEAVING_CHILDREN:
            whom = "only the main process" if self.kill_mode == "process" else "no process"
            found.append(
                f"{self.unit} has KillMode={self.kill_mode}: a stop signals {whom}, so vLLM's EngineCore "
                "and workers can survive it and keep their GPU memory"
            )
        if self.container and not self.has_exec_stop:
            found.append(
                f"{self.unit} runs `{self.container} run` without ExecStop=: a stop ends the client, the "
                f"container can outlive it (the SIGKILL after TimeoutStopSec reaches only the client); "
                f"`ExecStop={self.container} stop NAME` stops the container itself"
            )
        drain = self.drain_cut()
        if drain:
            found.append(drain)
        return found

    def drain_cut(self) -> str | None:
        """vLLM's drain (--shutdown-timeout) not ending before systemd's SIGKILL (TimeoutStopSec)."""
        drain, limit = self.shutdown_timeout_s, self.timeout_stop_s
        if not drain or limit is None or limit > drain:
            return None
        return (
            f"vLLM's --shutdown-timeout {drain} drains requests for up to {drain} s after SIGTERM, but "
            f"{self.unit}'s TimeoutStopSec is {limit:g} s: systemd kills the drain (raise TimeoutStopSec "
            f"above {drain} s, or lower --shutdown-timeout)"
        )


@dataclass(frozen=True)
class GpuHolder:
    """A process of the old instance that still holds memory on one of the service's GPUs."""

    gpu: int
    pid: int
    name: str
    used_bytes: int | None  # None: the driver does not say

    def text(self) -> str:
        memory = gib(self.used_bytes) if self.used_bytes is not None else "memory (NVML says not how much)"
        return f"PID {self.pid} ({self.name or 'no name'}) holds {memory} on GPU {self.gpu}"


def gpu_holders(gpus: GpuState, pids: Collection[int]) -> list[GpuHolder]:
    """The processes of `pids` (the old instance's) that NVML lists on these GPUs."""
    return [
        GpuHolder(gpu.index, p.pid, p.name, p.used_bytes)
        for gpu in gpus.gpus
        for p in gpu.processes
        if p.pid in pids and p.used_bytes != 0
    ]


def holders_text(held: Sequence[GpuHolder]) -> str:
    """Each holding process once: its PID, name, the memory it holds in all and on which GPUs."""
    by_pid: dict[int, list[GpuHolder]] = {}
    for holder in held:
        by_pid.setdefault(holder.pid, []).append(holder)
    parts = []
    for pid, mine in by_pid.items():
        if len(mine) == 1:
            parts.append(mine[0].text())
            continue
        sizes = {h.used_bytes for h in mine}
        gpus = ", ".join(str(h.gpu) for h in mine)
        if None in sizes:
            memory = "memory (NVML says not how much) on"
        elif len(sizes) == 1:
            memory = f"{gib(mine[0].used_bytes)} on each of"
        else:
            memory = f"{gib(sum(h.used_bytes or 0 for h in mine))} in all on"
        parts.append(f"PID {pid} ({mine[0].name or 'no name'}) holds {memory} GPUs {gpus}")
    return "; ".join(parts)
