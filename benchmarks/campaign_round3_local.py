"""Hostile-input campaign of issue 29 (round three), the classes one host can try by itself: the
--textfile writer in a directory others may write, echoed journal lines and impossible figures, a full
state directory, exit codes of a crash and of a node, terminal controls in what a node or a journal
says, a deployment file's hosts, unbounded --gpus-from / gpus_from reads, and the collection's
parameters and HAProxy admin states; and the wire between a deployment's coordinator and its nodes,
over the real `local` path to a stand-in `ctxmgr node` (every vLLM flag a head might name, hostile
answers at every step, a worker that fails while the head waits, the way forward after a failed
attempt). Each trial runs in a forked child with a timeout (or, where it
needs its own mount namespace or address-space limit, in a child process); each section prints
`tried` and `failed` (an unhandled exception, a hang, an error of more than one line, a victim file
changed, an echo learned, an impossible figure planned from, an OSError out of the store, an exit
code outside ctxmgr's, a control character printed, a hostile host accepted, a read without end, a
parameter dropped, a hostile name sent, a flag other than a context change's written or asked for, a
node's faulty answer not named in one line or leaving a written node unrestored, a failing worker
noticed late or not named first, a rollback target other than the last good change).

    .venv/bin/python benchmarks/campaign_round3_local.py [SECTION ...] [--seed 29] [--timeout 20] [--show 5]

SECTION: textfile, journal, state-full, exit-codes, controls, hosts, gpus-from, collection, wire-flags,
node-answers, worker-fails, way-forward (default: all). textfile and state-full need root (another
uid's files; `unshare -m` and a tmpfs). The four wire sections take about 7 minutes on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import random
import resource
import shutil
import stat
import subprocess
import sys
import time
import uuid
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_ctxmgr.deployment.wire import WIRE_VERSION  # noqa: E402
from vllm_ctxmgr.errors import CtxmgrError  # noqa: E402

WORK = REPO / ".cache" / "campaign-round3" / str(os.getpid())  # one run's own: runs may overlap
NOBODY = 65534
MODEL = REPO / "examples" / "models" / "qwen3-32b"
LOGS = [REPO / "tests" / "data" / "vllm-logs", Path("/work/shared/vllm-logs")]


# ---- running one trial ------------------------------------------------------------------------


from trials import Tally, isolated, outcome_problem, run_sections  # noqa: E402  (benchmarks/trials.py)


def needs_root(name: str) -> bool:
    if os.geteuid() != 0:
        print(f"{name:<16} skipped: needs root")
        return False
    return True


# ---- item 3: --textfile in a directory others may write -------------------------------------------


def _verification() -> Any:
    from vllm_ctxmgr.core.verdict import OK, Verification

    return Verification(service="vllm-x", result=OK, time=1.0, max_model_len=4096)


PLANTS = ("nothing", "link to victim", "dangling link", "hard link to victim", "fifo", "directory",
          "their file", "our file", "link at temporary")  # fmt: skip


def _plant(directory: Path, target: Path, victim: Path, plant: str) -> None:
    if plant in ("link to victim", "link at temporary"):
        link = target if plant == "link to victim" else directory / f".{target.name}.{'00' * 6}.ctxmgr-tmp"
        link.symlink_to(victim)
        os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    elif plant == "dangling link":
        target.symlink_to(directory / "nowhere")
        os.chown(target, NOBODY, NOBODY, follow_symlinks=False)
    elif plant == "hard link to victim":
        os.link(victim, target)
    elif plant == "fifo":
        os.mkfifo(target)
        os.chown(target, NOBODY, NOBODY)
    elif plant == "directory":
        target.mkdir()
        os.chown(target, NOBODY, NOBODY)
    elif plant in ("their file", "our file"):
        target.write_text("# planted\n")
        if plant == "their file":
            os.chown(target, NOBODY, NOBODY)


def campaign_textfile(args: argparse.Namespace) -> int:
    if not needs_root("textfile"):
        return 0
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_ctxmgr.monitor.metrics import write_textfile

    tally = Tally("textfile", args.show)
    modes = (0o755, 0o700, 0o775, 0o777, 0o757, 0o770, 0o1777, 0o1775, 0o1757, 0o3777)
    for mode, owner, plant in itertools.product(modes, (0, NOBODY), PLANTS):
        base = WORK / "textfile" / uuid.uuid4().hex[:8]
        (base / "secrets").mkdir(parents=True)
        victim = base / "secrets" / "shadow"
        victim.write_text("root:secret\n")
        victim.chmod(0o600)
        directory = base / "prom"
        directory.mkdir()
        directory.chmod(mode)
        os.chown(directory, owner, owner)
        target = directory / "F.prom"
        _plant(directory, target, victim, plant)
        shared = bool(mode & 0o022)

        def trial(target: Path = target) -> str:
            os.urandom = lambda n: b"\x00" * n  # type: ignore[assignment]  # the name a guesser must hit
            write_textfile(target, _verification())
            return "written"

        outcome = isolated(trial, args.timeout)
        problem = outcome_problem(outcome)
        label = f"dir {mode:04o} uid {owner}, {plant}"
        st = victim.stat()
        if problem is None and (st.st_mode & 0o7777 != 0o600 or victim.read_text() != "root:secret\n"):
            problem = f"the victim changed: mode {st.st_mode & 0o7777:04o}"
        if problem is None and outcome[0] == "ok":
            must_refuse = owner != 0 or (shared and not mode & stat.S_ISVTX)
            must_refuse |= shared and plant in (
                "link to victim",
                "dangling link",
                "fifo",
                "directory",
                "their file",
            )
            written = target.lstat()
            if must_refuse:
                problem = "written where it must be refused"
            elif (
                not stat.S_ISREG(written.st_mode) or written.st_mode & 0o7777 != 0o644 or written.st_uid != 0
            ):
                problem = f"the textfile is {written.st_mode:o} uid {written.st_uid}"
            else:
                try:
                    names = {f.name for f in text_string_to_metric_families(target.read_text())}
                except ValueError as exc:
                    names, problem = set(), f"the textfile does not parse ({exc})"
                if problem is None and "ctxmgr_verify_success" not in names:
                    problem = "the textfile has no ctxmgr_verify_success"
        if problem is None and outcome[0] == "refused" and str(target.parent) not in outcome[1]:
            problem = f"the refusal names no path: {outcome[1][:100]}"
        tally.add(label, problem)
        shutil.rmtree(base, ignore_errors=True)
    return tally.report()


# ---- item 1: a start is one invocation, up to its ready line; no figure above its GPU --------------


ECHOES = [
    "vLLM API server version 0.99.0",
    "(APIServer pid=87) INFO 11-30 00:29:09 [api_utils.py:347]        █     █     █▄   ▄█",
    "Available KV cache memory: 9999.00 GiB",
    "Available KV cache memory: 0.01 GiB",
    "Model loading took 1.00 GiB and 0.5 seconds",
    "Model loading took 900.00 GiB and 0.5 seconds",
    "Estimated CUDA graph memory: 700.00 GiB total",
    "GPU KV cache size: 9,999,999 tokens",
    "Maximum concurrency for 4,096 tokens per request: 9999.00x",
    "Starting vLLM server on http://0.0.0.0:9999",
    "INFO:     Application startup complete.",
    "Using max model len 1",
    "ValueError: To serve at least one request with the models's max seq len (4096), (9.00 GiB KV cache "
    "is needed, which is larger than the available KV cache memory (0.01 GiB).",
]


def _logs_with_ready() -> list[tuple[str, list[str]]]:
    from vllm_ctxmgr.vllm_log.patterns import classify

    found = []
    for folder in LOGS:
        for path in sorted(folder.glob("*.log")) if folder.is_dir() else []:
            lines = path.read_text(encoding="utf-8", errors="replace").rstrip("\n").split("\n")
            if any((e := classify(line)) is not None and e.kind == "ready" for line in lines):
                found.append((f"{folder.name}/{path.name}", lines))
    return found


def campaign_journal(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState
    from vllm_ctxmgr.core.observations import Observation
    from vllm_ctxmgr.core.plan import PlanOptions, make_plan
    from vllm_ctxmgr.core.serve_args import ServeArgs
    from vllm_ctxmgr.model_files.load import load_model_facts
    from vllm_ctxmgr.vllm_log import watcher
    from vllm_ctxmgr.vllm_log.watcher import observe_start

    # a ctxmgr before issue 29 (a "before" run): the journal paths cut starts by banners, not invocations
    last_invocation_start = getattr(
        watcher, "last_invocation_start", lambda entries: watcher.last_start([m for _, m in entries])
    )
    up_to_ready = getattr(watcher, "up_to_ready", lambda lines: watcher.split_starts(lines)[0])

    tally = Tally("journal", args.show)
    rng = random.Random(args.seed)
    for name, lines in _logs_with_ready():
        real = observe_start(up_to_ready(lines))
        for trial_number in range(12):
            echoes = rng.sample(ECHOES, rng.randint(1, 6))
            after = rng.randint(0, 5)
            ready = next(
                i
                for i, line in enumerate(lines)
                if "Starting vLLM server" in line or "startup complete" in line
            )
            serving = lines[: ready + 1 + after] + echoes + lines[ready + 1 + after :]
            invocation = uuid.uuid4().hex
            entries = [(invocation, line) for line in serving]
            if trial_number % 3 == 0:  # an older invocation before it: a crash loop's
                entries = [(uuid.uuid4().hex, line) for line in ECHOES] + entries

            def trial(entries: list[tuple[str | None, str]] = entries) -> Any:
                return observe_start(last_invocation_start(entries))

            outcome = isolated(trial, args.timeout)
            problem = outcome_problem(outcome)
            if problem is None and outcome[0] == "ok" and outcome[1] != real:
                problem = f"an echo was learned: {outcome[1]}"
            tally.add(f"{name} + {len(echoes)} echoes", problem)

    # figures above the GPU: ignored by the planner, never planned from
    total = 80 * GIB
    gpus = GpuState(
        tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", total, total - GIB, GIB) for i in range(1)), "nvml"
    )
    facts = load_model_facts(str(MODEL))
    args_ = ServeArgs(str(MODEL), max_model_len=4096)
    options = PlanOptions(4096)
    estimated = make_plan(facts, args_, gpus, options)
    base = Observation(vllm_version="0.33.0", gpu_memory_utilization=0.9, model_loading_gib=61.0,
                       available_kv_gib=8.0, cuda_graph_gib=1.0)  # fmt: skip
    for _ in range(150):
        figures = {
            key: rng.choice([rng.uniform(0, 79), rng.uniform(80.01, 10_000), None])
            for key in ("model_loading_gib", "available_kv_gib", "cuda_graph_gib")
        }
        observation = replace(base, **figures)
        known = [v for v in figures.values() if v is not None]
        impossible = any(v * GIB > total for v in known) or (
            ((figures["model_loading_gib"] or 0) + (figures["available_kv_gib"] or 0)) * GIB > total
        )

        def plan_trial(observation: Observation = observation) -> Any:
            plan = make_plan(facts, args_, gpus, options, [observation])
            return plan.to_json() | {"notes": []}, plan.notes

        outcome = isolated(plan_trial, args.timeout)
        problem = outcome_problem(outcome)
        if problem is None and outcome[0] == "ok" and impossible:
            planned, notes = outcome[1]
            if planned != estimated.to_json() | {"notes": []} or not any("exceed" in n for n in notes):
                problem = "planned from figures its GPU cannot hold"
        tally.add(f"figures {figures}", problem)
    return tally.report()


# ---- item 2: a full state directory -----------------------------------------------------------------


def _full_trials(root: Path, seed: int) -> list[dict[str, Any]]:
    """Run inside `unshare -m` with a 256 KiB tmpfs at `root`: fill it to a random level, then write."""
    from vllm_ctxmgr.store import Revision, ServiceStore, State

    rng = random.Random(seed)
    results = []
    operations = ("new_revision", "save", "add_observation", "write_json", "lock", "ensure")
    for index in range(120):
        operation = operations[index % len(operations)]
        for entry in root.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        store = ServiceStore(root / "state", "vllm-x")
        rev = Revision(
            0, "vllm-x", State.BASELINE, "/etc/systemd/system/vllm-x.service", time.time(), plan={"a": 1}
        )
        with contextlib.suppress(CtxmgrError):
            store.new_revision(rev, unit=b"x" * 2000, previous=b"y" * 2000)
        left = rng.choice([0, 0, 1, 100, 1000, 4096, 9000, 20000])
        with open(root / "filler", "wb", buffering=0) as handle:
            try:
                while True:
                    handle.write(b"\0" * 4096)
            except OSError:
                pass
        if left:
            os.truncate(root / "filler", max(0, os.path.getsize(root / "filler") - left))
        big = "z" * rng.choice([10, 3000, 50_000])
        outcome = "ok"
        try:
            if operation == "new_revision":
                store.new_revision(replace(rev, number=1), unit=big.encode(), previous=b"p")
            elif operation == "save":
                rev.reason = big
                store.save(rev)
            elif operation == "add_observation":
                store.add_observation({"note": big})
            elif operation == "write_json":
                store.write_json("last-verify.json", {"note": big})
            elif operation == "lock":
                with store.lock(0.0):
                    pass
            else:
                store.ensure()
        except CtxmgrError as exc:
            outcome = f"refused: {exc}"
        except BaseException as exc:
            outcome = f"unhandled: {type(exc).__name__}: {exc}"
        results.append({"label": f"{operation}, {left} bytes left, {len(big)} to write", "outcome": outcome})
    return results


def campaign_state_full(args: argparse.Namespace) -> int:
    if not needs_root("state-full"):
        return 0
    tally = Tally("state-full", args.show)
    root = WORK / "full"
    root.mkdir(parents=True)
    script = (
        f"mount -t tmpfs -o size=256k,mode=0700 ctxmgr-campaign {root} && "
        f"exec {sys.executable} {Path(__file__).resolve()} --inner-full {root} --seed {args.seed}"
    )
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=600)
    try:
        results = json.loads(done.stdout)
    except ValueError:
        tally.add("the namespace run", f"no results ({done.stderr.strip()[-300:]})")
        return tally.report()
    for result in results:
        outcome = result["outcome"]
        problem = None
        if outcome.startswith("unhandled"):
            problem = outcome[:200]
        elif outcome.startswith("refused"):
            if "\n" in outcome:
                problem = "an error of more than one line"
            elif str(root) not in outcome:
                problem = f"the refusal names no path: {outcome[:120]}"
        tally.add(result["label"], problem)
    return tally.report()


# ---- item 7: a crash's own exit code; a node's code checked ---------------------------------------


def campaign_exit_codes(args: argparse.Namespace) -> int:
    from ansible_collections.vllm.ctxmgr.plugins.modules import ctxmgr as module
    from vllm_ctxmgr import errors
    from vllm_ctxmgr.deployment.remote import Link, NodeError
    from vllm_ctxmgr.errors import ExitCode, VerifyExit

    tally = Tally("exit-codes", args.show)
    documented = getattr(errors, "DOCUMENTED_EXIT_CODES", {int(c) for c in (*ExitCode, *VerifyExit)})
    crash = int(getattr(ExitCode, "INTERNAL", ExitCode.ERROR))  # before: a crash exited 1
    verdicts = {int(c) for c in (*ExitCode, *VerifyExit) if c.name != "INTERNAL"}
    tally.add(
        "a crash's code is no verdict",
        None if int(crash) not in verdicts else f"{int(crash)} is a verdict's code",
    )
    # before: the module passed verify's 0 and 1 whatever they meant
    passes = getattr(
        module,
        "passes",
        lambda command, data: data["exit_code"] == 0 or (command == "verify" and data["exit_code"] == 1),
    )
    said_values: list[Any] = [*range(-3, 12), 64, 69, 70, 71, 126, 127, 128, 137, 255, 256, 257, 512, 1 << 40,
                              True, False, None, "2", "70", 1.0, 2.5, [], {}, "x" * 100]  # fmt: skip
    script = WORK / "node.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    for said in said_values:
        script.write_text(
            "import json, sys\n"
            f"print(json.dumps({{'error': 'the probe failed', 'exit_code': {json.dumps(said)}}}))\n"
            "sys.exit(1)\n"
        )

        def trial(said: Any = said) -> Any:
            try:
                Link(local_ctxmgr=(sys.executable, str(script))).call("local", ["node", "verify", "u"], 30)
            except NodeError as exc:
                return exc.exit_code, exc.message
            return None, ""

        outcome = isolated(trial, args.timeout)
        problem = outcome_problem(outcome)
        if problem is None and outcome[0] == "ok":
            code, message = outcome[1]
            if code not in documented or code == 0:
                problem = f"the node's failure exits {code!r}"
            elif "\n" in message:
                problem = "an error of more than one line"
        tally.add(f"node answers exit_code {str(said)[:20]!r}", problem)
    for command, code, result in itertools.product(
        ("verify", "set-context", "rollback", "plan"),
        (0, 1, 2, 3, 4, 5, 6, 70, 255),
        ("ok", "degraded", "error", "applied"),
    ):
        data = {"exit_code": code, "result": result}
        should = (code == 0 and result != "error") or (
            command == "verify" and code == 1 and result == "degraded"
        )
        passed = passes(command, data)
        tally.add(f"module {command} exit {code} {result}", None if passed == should else f"passes: {passed}")
    return tally.report()


# ---- item 14: terminal controls in what a node or a journal says -----------------------------------


CONTROLS = [chr(c) for c in (*range(0, 9), *range(11, 32), 127, *range(128, 160))]
SEQUENCES = ["\x1b[2K", "\x1b[1A", "\r", "\x1b[32m", "\x1b[0m", "\x1b]0;title\x07", "\x1b]8;;http://x\x1b\\",
             "\x9b2J", "\x1bc", "\x1b7", "\x07", "\x08\x08\x08", "\x1b[?1049h"]  # fmt: skip


def campaign_controls(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.cli.output import echo

    tally = Tally("controls", args.show)
    rng = random.Random(args.seed)
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(1, 8)):
            parts.append(
                rng.choice([rng.choice(SEQUENCES), rng.choice(CONTROLS), "all nodes OK", "é€", " \t", "\n"])
            )
        text = "".join(parts)

        def trial(text: str = text) -> str:
            buffer = io.StringIO()
            with redirect_stdout(buffer):
                echo(f"node 1: {text}")
            return buffer.getvalue()

        outcome = isolated(trial, args.timeout)
        problem = outcome_problem(outcome)
        if problem is None and outcome[0] == "ok":
            bad = [c for c in outcome[1] if c in CONTROLS]
            if bad:
                problem = f"printed {bad[0]!r}"
        tally.add(repr(text)[:60], problem)
    return tally.report()


# ---- item 12: a deployment file's hosts --------------------------------------------------------------


HOSTILE_HOSTS = ["-oProxyCommand=touch /x", "-F/etc/passwd", "gpu b", "gpu\nb", "gpu\tb", "gpu\rb",
                 "gpu\x1bb",
                 "gpu\x00b", "gpu\x7fb", "gpu\u0085b", "gpu\u00a0b", "gpu\u2028b", " gpu", "gpu ", "", "-",
                 "--", "-gpu"]  # fmt: skip
HOSTILE_SERVICES = ["-x", "--help", "vllm glm5", "vllm\nglm5", "vllm\x1b", ""]


def campaign_hosts(args: argparse.Namespace) -> int:
    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main
    from vllm_ctxmgr.deployment.remote import NodeAddress

    tally = Tally("hosts", args.show)
    directory = WORK / "hosts"
    directory.mkdir(parents=True, exist_ok=True)
    cases = [(h, "vllm-glm5") for h in HOSTILE_HOSTS] + [("gpu-b", s) for s in HOSTILE_SERVICES]
    cases += [(h, s) for h in HOSTILE_HOSTS[:6] for s in HOSTILE_SERVICES[:3]]
    for host, service in cases:
        path = directory / f"{uuid.uuid4().hex[:8]}.toml"
        path.write_text(f"[[node]]\nhost = {json.dumps(host)}\nservice = {json.dumps(service)}\n")

        def trial(path: Path = path) -> Any:
            result = CliRunner().invoke(main, ["deployment", "plan", "4096", "--file", str(path), "--json"])
            return result.exit_code, result.stdout

        outcome = isolated(trial, args.timeout)
        problem = outcome_problem(outcome)
        if problem is None and outcome[0] == "ok":
            code, stdout = outcome[1]
            try:
                error = json.loads(stdout).get("error", "")
            except ValueError:
                error = stdout
            if code != 2 or str(path) not in error:
                problem = f"not refused at the file (exit {code}: {error[:100]})"
        tally.add(f"{host!r}:{service!r}", problem)
    for good in ("gpu-b:vllm-glm5", "[fd00::2]:vllm", "10.0.0.2:vllm-glm5.service", "local:vllm@1"):
        outcome = isolated(lambda good=good: str(NodeAddress.parse(good)), args.timeout)
        tally.add(f"parse {good}", None if outcome == ("ok", good) else f"{outcome}")
    return tally.report()


# ---- item 6 (files): --gpus-from and gpus_from ------------------------------------------------------


def _cli_bounded(cli_args: list[str], timeout: float) -> tuple[int, str, float]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "vllm_ctxmgr", *cli_args],
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=limit,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return -1, "", time.monotonic() - started
    return done.returncode, done.stdout, time.monotonic() - started


def campaign_gpus_from(args: argparse.Namespace) -> int:
    import socket

    tally = Tally("gpus-from", args.show)
    directory = WORK / "gpus"
    directory.mkdir(parents=True, exist_ok=True)
    gpu = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 85_899_345_920,
           "free_bytes": 85_000_000_000, "used_bytes": 899_345_920}  # fmt: skip
    good = {"source": "nvml", "gpus": [gpu]}
    kinds: dict[str, Path] = {"/dev/zero": Path("/dev/zero"), "/dev/urandom": Path("/dev/urandom"),
                              "/dev/null": Path("/dev/null")}  # fmt: skip
    fifo = directory / "fifo.json"
    os.mkfifo(fifo)
    kinds["fifo"] = fifo
    kinds["directory"] = directory / "adir"
    kinds["directory"].mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(directory / "sock.json"))
    kinds["socket"] = directory / "sock.json"
    (directory / "huge.json").write_text(json.dumps(good) + " " * (3 << 20))
    kinds["huge"] = directory / "huge.json"
    (directory / "zero-link.json").symlink_to("/dev/zero")
    kinds["link to /dev/zero"] = directory / "zero-link.json"
    (directory / "fifo-link.json").symlink_to(fifo)
    kinds["link to a fifo"] = directory / "fifo-link.json"
    (directory / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    kinds["deep JSON"] = directory / "deep.json"
    (directory / "good.json").write_text(json.dumps(good))
    kinds["good"] = directory / "good.json"
    for name, path in kinds.items():
        code, stdout, _ = _cli_bounded(
            ["plan", "4096", "--model", str(MODEL), "--gpus-from", str(path), "--json"], args.timeout
        )
        problem = None
        if code == -1:
            problem = f"hang: over {args.timeout:g} s"
        elif name == "good":
            problem = None if code == 0 else f"exit {code}: {stdout[:120]}"
        elif code != 2 or "unexpected" in stdout:
            problem = f"exit {code}: {stdout[:120]}"
        tally.add(f"--gpus-from {name}", problem)
    deploy = directory / "deploy"
    deploy.mkdir()
    (directory / "outside.json").write_text(json.dumps(good))
    values = {**{name: str(path) for name, path in kinds.items() if name != "good"},
              "../outside.json": "../outside.json", "a/../../outside.json": "a/../../outside.json",
              "fifo beside": "fifo.json"}  # fmt: skip
    os.mkfifo(deploy / "fifo.json")
    for name, value in values.items():
        toml = deploy / "d.toml"
        toml.write_text(f'[[node]]\nhost = "local"\nservice = "vllm-x"\ngpus_from = {json.dumps(value)}\n')
        code, stdout, _ = _cli_bounded(
            ["deployment", "plan", "4096", "--file", str(toml), "--json"], args.timeout
        )
        problem = None
        if code == -1:
            problem = f"hang: over {args.timeout:g} s"
        elif code != 2 or "unexpected" in stdout:
            problem = f"exit {code}: {stdout[:120]}"
        tally.add(f"gpus_from {name}", problem)
    for name in ("/dev/zero", "fifo", "directory", "huge"):
        code, stdout, _ = _cli_bounded(
            ["deployment", "plan", "4096", "--file", str(kinds[name]), "--json"], args.timeout
        )
        problem = f"hang: over {args.timeout:g} s" if code == -1 else None
        if problem is None and (code != 2 or "unexpected" in stdout):
            problem = f"exit {code}: {stdout[:120]}"
        tally.add(f"--file {name}", problem)
    sock.close()
    return tally.report()


# ---- item 13: the collection's parameters and HAProxy's admin state ----------------------------------


def campaign_collection(args: argparse.Namespace) -> int:
    import socket
    import threading

    from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import HaproxyError, Runtime
    from ansible_collections.vllm.ctxmgr.plugins.modules import ctxmgr as module

    tally = Tally("collection", args.show)
    rng = random.Random(args.seed)
    base = {"service": "vllm-glm5", "context": 4096, "ctxmgr_bin": "ctxmgr", "state_dir": None,
            "systemd_pid": None,
            "extra_args": [], "force": False, "long_probe": False}  # fmt: skip
    carried = {"--to", "--wait-lock", "--probe-tokens", "--long-probe", "--timeout",
               "--gpu-memory-utilization",
               "--force", "--edit"}  # fmt: skip
    for _ in range(200):
        params = {**base, "command": rng.choice(["set-context", "rollback", "verify", "plan"])}
        for key, values in (("to", [None, 0, 3]), ("wait_lock", [None, 0.0, 30.0]),
                            ("probe_tokens", [None, 1, 1000]),
                            ("long_probe", [False, True]), ("timeout", [None, 60.0]),
                            ("gpu_memory_utilization", [None, 0.9]), ("force", [False, True]),
                            ("edit", ["in-place", "dropin"])):  # fmt: skip
            params[key] = rng.choice(values)
        check = rng.random() < 0.3
        single = module.command_argv(params, check)
        nodes = module.command_argv({**params, "nodes": ["local:vllm-glm5", "gpu-b:vllm-glm5"]}, check)
        dropped = [w for w in single if w in carried and w not in nodes]
        tally.add(f"{params['command']} {sorted(k for k in params if params[k] not in (None, False))}",
                  f"dropped with nodes: {dropped}" if dropped else None)  # fmt: skip
    directory = WORK / "hap"
    directory.mkdir(parents=True, exist_ok=True)
    admin_values = ["0", "1", "8", "9", "32", "x", "-1", "1e3", "0x8", "", "9" * 20, "8.0", "٣"]
    names = ["vllm", "be1 extra args", "be1;help", "be1\nshow info", "", "a" * 101, "vllm/x", "vllm\x00"]
    for admin, backend in itertools.product(admin_values, names):
        path = str(directory / f"{uuid.uuid4().hex[:8]}.sock")
        received: list[str] = []
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(4)
        answer = (
            "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight\n"
            f"3 vllm 1 h1 10.0.0.1 2 {admin or '-'} 1\n"
        )

        def serve(server: Any = server, answer: str = answer, received: list[str] = received) -> None:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                received.append(conn.recv(4096).decode(errors="replace"))
                conn.sendall(answer.encode())

        threading.Thread(target=serve, daemon=True).start()

        def trial(path: str = path, backend: str = backend) -> str:
            runtime = Runtime(path, timeout=2)
            try:
                if hasattr(runtime, "admin_state"):
                    return runtime.admin_state(backend, "h1")
                from ansible_collections.vllm.ctxmgr.plugins.modules import haproxy_server  # before

                return haproxy_server.admin_state(runtime, backend, "h1")
            except HaproxyError as exc:
                return f"refused: {exc}"

        outcome = isolated(trial, args.timeout)
        problem = outcome_problem(outcome)
        if problem is None and outcome[0] == "ok":
            value = outcome[1]
            if backend != "vllm" and received:
                problem = f"a hostile backend was sent: {received[0]!r}"
            elif backend == "vllm" and admin.isascii() and admin.isdigit() and len(admin) <= 6:
                expected = "maint" if int(admin) & 1 else "drain" if int(admin) & 8 else "ready"
                problem = None if value == expected else f"read {value!r}, expected {expected}"
            elif not value.startswith("refused"):
                problem = f"garbage read as {value!r}"
            elif "\n" in value:
                problem = "an error of more than one line"
        tally.add(f"admin {admin[:8]!r} backend {backend[:12]!r}", problem)
        server.close()
    return tally.report()


# ---- the wire between the coordinator and its nodes (items 4, 5, 14, 15, 16) ---------------------
# A stand-in `ctxmgr node` on the real `local` path (Link runs it as a subprocess, as ssh would run
# ctxmgr there): it answers each step from answers.json in its folder (by `STEP SERVICE`, with
# ` back` for a rollback's start), logs every call with its request, and can be made to print raw
# bytes, exit with any code, or (the head's start) wait until the head is stopped.

STAND_IN_NODE = r"""
import base64, json, os, sys, time
here, args = sys.argv[1], sys.argv[2:]
step = args[args.index("node") + 1]
service = [a for a in args if a.endswith(".service")][0]
request = sys.stdin.read()
with open(os.path.join(here, "calls.jsonl"), "a") as log:
    log.write(json.dumps([step, service, args, request]) + "\n")
answers = json.load(open(os.path.join(here, "answers.json")))
key = f"{step} {service}"
entry = answers.get(key + " back" if "--back" in args else key) or answers[key]
marker = os.path.join(here, "stopped-" + service)
if step == "stop":
    open(marker, "w").close()
if entry.get("until_stopped"):
    if os.path.exists(marker):
        os.remove(marker)
    deadline = time.monotonic() + entry["until_stopped"]
    while time.monotonic() < deadline and not os.path.exists(marker):
        time.sleep(0.05)
if entry.get("sleep"):
    time.sleep(entry["sleep"])
if "raw" in entry:
    sys.stdout.buffer.write(base64.b64decode(entry["raw"]))
else:
    sys.stdout.write(json.dumps(entry["json"]))
sys.stdout.flush()
sys.exit(entry.get("exit", 0))
"""


def _node_bed(answers: dict[str, dict[str, Any]]) -> Path:
    """A folder with the stand-in node, its answers and a deployment file naming two `local` nodes."""
    bed = WORK / "nodes" / uuid.uuid4().hex[:8]
    bed.mkdir(parents=True)
    (bed / "node.py").write_text(STAND_IN_NODE)
    (bed / "answers.json").write_text(json.dumps(answers))
    words = json.dumps([sys.executable, str(bed / "node.py"), str(bed)])
    (bed / "d.toml").write_text(
        'name = "campaign"\n'
        + "".join(
            f'[[node]]\nhost = "local"\nservice = "vllm-n{r}.service"\nctxmgr = {words}\n' for r in (0, 1)
        )
    )
    return bed


def _calls(bed: Path) -> list[tuple[str, str, list[str], str]]:
    path = bed / "calls.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(json.loads(line)) for line in lines]  # type: ignore[misc]


def _written(bed: Path) -> set[str]:
    """The nodes a stand-in bed was asked to write (a prepare that is no dry run)."""
    return {
        service for step, service, words, _ in _calls(bed) if step == "prepare" and "--dry-run" not in words
    }


def _walk(**overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every step's answer of a two-node change that serves (tests/deployment/test_wire.py's), as
    stand-in entries."""
    from tests.deployment.test_wire import walk_answers

    return {key: {"json": answer} for key, answer in walk_answers().items()} | overrides


def _cli(bed: Path, *words: str, as_json: bool = True) -> tuple[int, dict[str, Any], str]:
    """`ctxmgr --state-dir BED/state WORDS --file BED/d.toml [--json]` in this process (a forked
    trial): (exit code, its JSON object, everything it printed, stderr too)."""
    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main

    argv = ["--state-dir", str(bed / "state"), *words, "--file", str(bed / "d.toml")]
    argv += ["--json"] if as_json else []
    result = CliRunner().invoke(main, argv)
    try:
        data = json.loads(result.stdout)
    except ValueError:
        data = {}
    return result.exit_code, data, result.output


def _one_line_naming(text: str, node: str) -> str | None:
    if "\n" in text.strip():
        return f"not one line: {text[:100]!r}"
    if node not in text:
        return f"{node} is not named: {text[:160]!r}"
    if "unexpected error" in text or "Traceback" in text:
        return f"a crash: {text[:160]!r}"
    return None


GPU_WORDS = ("--gpu-memory", "80GiB", "--gpu-count", "8")
CHANGE = ("deployment", "set-context", "16384", *GPU_WORDS, "--yes")


def campaign_wire_flags(args: argparse.Namespace) -> int:
    """Item 4: only the flags a context change writes, with values in range, cross the wire, at both
    ends: the head's plan answer at the coordinator (nothing is prepared anywhere) and a node's
    `node prepare` request at its door (refused before any unit is read)."""
    from click.testing import CliRunner

    from tests.deployment.test_wire import plan_answer
    from vllm_ctxmgr.cli.main import main
    from vllm_ctxmgr.core.vllm_flag_list import VLLM_FLAGS
    from vllm_ctxmgr.deployment.wire import CONTEXT_ENV, CONTEXT_FLAGS, WIRE_VERSION, PlanAnswer, WireError

    tally = Tally("wire-flags", args.show)
    rng = random.Random(args.seed)
    allowed = {"--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes"}
    tally.add("the wire's context flags", None if set(CONTEXT_FLAGS) <= allowed else f"{CONTEXT_FLAGS}")
    names = sorted({name for row in VLLM_FLAGS for name in row[0]} - set(CONTEXT_FLAGS))
    names += [
        "--max_model_len",
        "--max-model-len=4096",
        "--MAX-MODEL-LEN",
        "max-model-len",
        "--max-model-len ",
        "-- --max-model-len",
        "--gpu-memory-utilization\n",
        "",
        "--",
        "\x1b[2K",
        "--model\x00",
    ]
    values = ["attacker_pkg.Ext", "", "/tmp/evil", "1", "x --trust-remote-code", "true"]
    bad_values = {
        "--max-model-len": [
            "0",
            "-1",
            "-16384",
            "1e5",
            "16384 --trust-remote-code",
            str((1 << 32) + 1),
            "",
            " 16384",
            "16384 ",
            "16384\n",
            "0x4000",
            "016384",
            "١٦٣٨٤",
            "16_384",
            "16384.0",
            "auto",
            "+16384",
            "9" * 30,
            "16384\x00",
        ],
        "--gpu-memory-utilization": [
            "nan",
            "inf",
            "-inf",
            "0",
            "-0.5",
            "1.0001",
            "1e-400",
            "2",
            "0.9 --model x",
            "",
            " 0.9",
            "0.9 ",
            "0.9\n",
            "\t0.9",
            "٠.٩",
            "0x1",
            "1_0",
            "0.9\x00",
            "NaN",
        ],
        "--kv-cache-memory-bytes": ["0", "-1", "1GiB", "1e9", str((1 << 50) + 1), "", "8589934592\n", "٨"],
    }
    good_values = {
        "--max-model-len": ["16384", "1", str(1 << 32)],
        "--gpu-memory-utilization": ["0.9", "1", "0.05", "1.0"],
        "--kv-cache-memory-bytes": ["8589934592"],
    }
    env_names = [
        "LD_PRELOAD",
        "PYTHONPATH",
        "VLLM_USE_V1",
        "CUDA_VISIBLE_DEVICES",
        "HF_TOKEN",
        "VLLM_ATTENTION_BACKEND",
        "vllm_allow_long_max_model_len",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN ",
        "A=B",
        "",
        "PATH",
    ]
    env_values = ["true", "01", " 1", "1\n", "2", "-1", "yes", "", "1; rm -rf /"]
    cases: list[tuple[dict[str, str], dict[str, str], bool]] = []
    for name in names:
        cases.append(({name: rng.choice(values)}, {}, False))
        cases.append(({"--max-model-len": "16384", name: rng.choice(values)}, {}, False))
    for name, bad in bad_values.items():
        cases += [
            ({"--max-model-len": "16384", name: v} if name != "--max-model-len" else {name: v}, {}, False)
            for v in bad
        ]
    for name, good in good_values.items():
        cases += [
            ({"--max-model-len": "16384", name: v} if name != "--max-model-len" else {name: v}, {}, True)
            for v in good
        ]
    cases += [({"--max-model-len": "16384"}, {name: "1"}, False) for name in env_names]
    cases += [({"--max-model-len": "16384"}, {CONTEXT_ENV[0]: v}, False) for v in env_values]
    cases += [({"--max-model-len": "16384"}, {CONTEXT_ENV[0]: v}, True) for v in ("0", "1")]

    def coordinator_end(flags: dict[str, str], env: dict[str, str]) -> str:
        try:
            PlanAnswer.from_json(plan_answer(flag_changes=flags, env_changes=env))
        except WireError as exc:
            return f"refused: {exc.message}"
        return "accepted"

    def node_end(flags: dict[str, str], env: dict[str, str], state: Path) -> tuple[int, str]:
        request = json.dumps({"wire": WIRE_VERSION, "flag_changes": flags, "env_changes": env})
        argv = [
            "--state-dir",
            str(state),
            "node",
            "prepare",
            "vllm-n1.service",
            "--change",
            "c1",
            "--max-model-len",
            "16384",
            "--expect-digest",
            "ab" * 32,
            "--dry-run",
            "--json",
        ]
        result = CliRunner().invoke(main, argv, input=request)
        return result.exit_code, result.stdout

    for flags, env, good in cases:
        label = f"{flags} {env}"
        outcome = isolated(lambda flags=flags, env=env: coordinator_end(flags, env), args.timeout)
        problem = outcome_problem(outcome)
        if problem is None:
            said = outcome[1]
            if good and said != "accepted":
                problem = f"a context change's own flag refused: {said}"
            elif not good and not said.startswith("refused: `node plan` answer: "):
                problem = f"coordinator: {said}"
            elif not good and "\n" in said:
                problem = "an error of more than one line"
        tally.add(f"coordinator {label}", problem)
        if good:
            continue
        state = WORK / "node-door" / uuid.uuid4().hex[:8]
        outcome = isolated(
            lambda flags=flags, env=env, state=state: node_end(flags, env, state), args.timeout
        )
        problem = outcome_problem(outcome)
        if problem is None:
            code, stdout = outcome[1]
            try:
                error = json.loads(stdout).get("error", "")
            except ValueError:
                error = stdout
            if code != 2 or "is not" not in error or "unexpected" in error or "\n" in error:
                problem = f"node: exit {code}: {error[:140]!r}"
            elif state.exists():
                problem = "the node touched its state before refusing"
        tally.add(f"node door {label}", problem)

    # the whole way: a head whose plan names another flag, through `ctxmgr deployment set-context`
    for name in rng.sample(names, 24):
        bed = _node_bed(
            _walk(
                **{
                    "plan vllm-n0.service": {
                        "json": plan_answer(
                            flag_changes={"--max-model-len": "16384", name: "attacker_pkg.Ext"}
                        )
                    }
                }
            )
        )
        outcome = isolated(lambda bed=bed: _cli(bed, *CHANGE), args.timeout)
        problem = outcome_problem(outcome)
        if problem is None:
            code, data, _ = outcome[1]
            problem = _one_line_naming(data.get("error", ""), "local:vllm-n0.service")
            if problem is None and code != 2:
                problem = f"exit {code}"
            if problem is None and any(step == "prepare" for step, *_ in _calls(bed)):
                problem = "a node was asked to prepare"
        tally.add(f"set-context, the head's plan names {name!r}", problem)
    return tally.report()


def _hostile_answers(step: str, service: str) -> dict[str, dict[str, Any]]:
    """What a broken or hostile node prints for one step (its answer in the wire's shape otherwise)."""
    import base64

    from tests.deployment.test_wire import walk_answers

    good = walk_answers()[f"{step} {service}"] if step != "plan" else walk_answers()["plan vllm-n0.service"]

    def raw(data: bytes, code: int = 0) -> dict[str, Any]:
        return {"raw": base64.b64encode(data).decode(), "exit": code}

    fields = [k for k in good if k not in ("wire", "schema", "command")]
    number = next(k for k in ("revision", "max_model_len", "ok", "service") if k in good)
    wrong_types = {k: v for k, v in good.items()}
    for k in fields[:3]:
        wrong_types[k] = [1, 2] if not isinstance(good[k], list) else "x"
    answers = {
        "not UTF-8": raw(b'{"ok": "\xff\xfe"}'),
        "not UTF-8, latin-1 text": raw('{"service": "vllm-é"}'.encode("latin-1")),
        "nested past the parser": raw(b"[" * 200_000 + b"]" * 200_000),
        "nested object": raw(b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        "oversized": raw(b'{"service": "' + b"x" * (17 << 20) + b'"}'),
        "not JSON": raw(b"Traceback (most recent call last):\n  boom"),
        "empty": raw(b""),
        "empty, exit 1": raw(b"", 1),
        "a list": raw(b"[1, 2, 3]"),
        "a number": raw(b"1e400"),
        "two objects": raw(json.dumps(good).encode() * 2),
        "NaN inside": raw(json.dumps({**good, number: float("nan")}).encode()),
        "huge integer": raw(json.dumps({**good, number: 10**400}).encode()),
        "wrong types": {"json": wrong_types},
        "missing fields": {"json": {"wire": good.get("wire")}},
        "wire version 1": {"json": {**good, "wire": 1}},
        "wire version 99": {"json": {**good, "wire": 99}},
        "no wire version": {"json": {k: v for k, v in good.items() if k != "wire"}},
        "wire version as text": {"json": {**good, "wire": "2"}},
        "error with controls": {
            "json": {"error": "\x1b[2K\r\x1b[32mall nodes OK\x1b[0m\nsecond", "exit_code": 1},
            "exit": 1,
        },
        "error, exit code 256": {"json": {"error": "failed", "exit_code": 256}, "exit": 1},
        "error, exit code as text": {"json": {"error": "failed", "exit_code": "2"}, "exit": 1},
        "exit 255 silent": raw(b"", 255),
        "killed by a signal": raw(b"", -9 & 0xFF),
    }
    return answers


# step -> (nodes it is asked of, what reaching it needs: a failing head start for the rollback steps)
NODE_STEPS = {
    "show": ("vllm-n0.service", "vllm-n1.service"),
    "plan": ("vllm-n0.service",),
    "prepare": ("vllm-n0.service", "vllm-n1.service"),
    "stop": ("vllm-n0.service", "vllm-n1.service"),
    "start": ("vllm-n0.service", "vllm-n1.service"),
    "check": ("vllm-n1.service",),
    "finish": ("vllm-n0.service", "vllm-n1.service"),
    "restore": ("vllm-n0.service", "vllm-n1.service"),
    "settle": ("vllm-n0.service", "vllm-n1.service"),
}


def campaign_node_answers(args: argparse.Namespace) -> int:
    """Item 5 (and 14 on the way out): any fault in any node's answer at any step is that node's
    failure: one line naming it, a documented exit code, and every node written put back (restore
    asked of each) and restarted; never "unexpected error", never a deployment left down."""
    from vllm_ctxmgr.errors import DOCUMENTED_EXIT_CODES

    tally = Tally("node-answers", args.show)
    rng = random.Random(args.seed)
    failing_head = {
        "json": {
            "wire": WIRE_VERSION,
            "service": "vllm-n0.service",
            "ok": False,
            "reason": "the probe failed: 500",
        }
    }
    for step, services in NODE_STEPS.items():
        for service in services:
            for kind, entry in _hostile_answers(step, service).items():
                if kind == "oversized" and rng.random() < 0.6:
                    continue  # 17 MiB each: a sample is enough
                overrides = {f"{step} {service}": entry}
                if step in ("restore", "settle"):  # reached by a change that fails at the head's probe
                    overrides["start vllm-n0.service"] = failing_head
                    overrides["start vllm-n0.service back"] = _walk()["start vllm-n0.service"]
                elif step == "start":
                    overrides[f"start {service} back"] = _walk()[f"start {service}"]
                bed = _node_bed(_walk(**overrides))
                outcome = isolated(lambda bed=bed: _cli(bed, *CHANGE), args.timeout * 3)
                problem = outcome_problem(outcome)
                label = f"{step} {service}: {kind}"
                if problem is None:
                    problem = _judge_node_answer(bed, outcome[1], step, service, DOCUMENTED_EXIT_CODES)
                tally.add(label, problem)
                if kind == "error with controls":  # item 14: what reaches the operator's terminal
                    (bed / "calls.jsonl").unlink(missing_ok=True)
                    shown = isolated(lambda bed=bed: _cli(bed, *CHANGE, as_json=False), args.timeout * 3)
                    problem = outcome_problem(shown)
                    if problem is None and any(c in shown[1][2] for c in CONTROLS if c not in "\n"):
                        problem = f"a control printed: {shown[1][2][:160]!r}"
                    if problem is None and "all nodes OK" in shown[1][2] and node_line(shown[1][2]) is None:
                        problem = "the node's text is printed apart from its name"
                    tally.add(f"{label}, on a terminal", problem)
                shutil.rmtree(bed, ignore_errors=True)
    return tally.report()


def node_line(printed: str) -> str | None:
    """The printed line that carries the node's own text, where it also names a node."""
    return next(
        (line for line in printed.splitlines() if "all nodes OK" in line and "local:vllm-n" in line), None
    )


def _judge_node_answer(
    bed: Path, run: tuple[int, dict[str, Any], str], step: str, service: str, documented: frozenset[int]
) -> str | None:
    code, data, printed = run
    node = f"local:{service}"
    if code not in documented:
        return f"exit {code}, not one of ctxmgr's"
    if any(c in printed for c in "\x1b\r\x07\x9b"):
        return "a terminal control printed"
    calls = _calls(bed)
    written = _written(bed)
    restored = {s for st, s, _a, _ in calls if st == "restore"}
    if "error" in data:  # refused before anything was written
        problem = _one_line_naming(data["error"], node)
        if problem is None and written:
            problem = f"refused after {sorted(written)} were written, nothing put back"
        if problem is None and code == 0:
            problem = "refused with exit 0"
        return problem
    result, reason = data.get("result"), data.get("reason", "")
    nodes = {f"{n['host']}:{n['service']}": n for n in data.get("nodes", [])}
    if step in ("finish",):  # after the deployment served: the node's own revision is what failed
        mine = nodes.get(node, {})
        if mine.get("ok", True):
            return f"the node's failed finish is not in its outcome: {mine}"
        return _one_line_naming(mine.get("reason", ""), node)
    if step == "settle":  # the last word of a rollback: the rollback stands, the node is named
        if result not in ("rolled-back", "rollback-failed") or code == 0:
            return f"{result}, exit {code}"
        if f"the rollback is not recorded on {node}: " not in reason or nodes.get(node, {}).get("ok", True):
            return f"a node whose settle failed is not named: {reason[:120]!r}"
        return None
    if result not in ("rolled-back", "rollback-failed") or code == 0:
        return f"{result} (exit {code}): {reason[:120]!r}"
    if written - restored:
        return f"written and not put back: {sorted(written - restored)}"
    return _one_line_naming(reason, node)


def campaign_worker_fails(args: argparse.Namespace) -> int:
    """Item 15 on the stand-in bed: a headless rank whose unit fails while the head's start waits for it
    (the stand-in head waits until it is stopped, up to 40 s) stops the change at once, with that rank's
    own cause first, and every node is put back; a check that is only slow is not a failure."""
    tally = Tally("worker-fails", args.show)
    cause = "ExecStartPre=/bin/false in 50-fault.conf exited 1"
    waiting_head = {
        "json": {
            "wire": WIRE_VERSION,
            "service": "vllm-n0.service",
            "ok": False,
            "reason": "waited 61 s for the other nodes",
        },
        "until_stopped": 40,
    }
    failed = {
        "wire": WIRE_VERSION,
        "service": "vllm-n1.service",
        "ok": False,
        "active_state": "failed",
        "reason": cause,
    }
    variants: dict[str, dict[str, Any]] = {
        "unit failed": {"json": failed},
        "vLLM's failure in its journal": {
            "json": {
                **failed,
                "active_state": "active",
                "decisive_line": "torch.OutOfMemoryError: CUDA out of memory",
                "reason": "CUDA out of memory on rank 9",
            }
        },
        "unit failed, with controls in its cause": {"json": {**failed, "reason": f"\x1b[2K\r{cause}"}},
    }
    for name, check in variants.items():
        for back_ok in (True, False):
            overrides = {"start vllm-n0.service": waiting_head, "check vllm-n1.service": check}
            if back_ok:  # the rollback's checks find the old configuration serving
                overrides["check vllm-n1.service back"] = _walk()["check vllm-n1.service"]
            bed = _node_bed(_walk(**overrides))
            started = time.monotonic()
            outcome = isolated(lambda bed=bed: _cli(bed, *CHANGE), 90)
            seconds = time.monotonic() - started
            problem = outcome_problem(outcome)
            if problem is None:
                code, data, printed = outcome[1]
                reason = data.get("reason", "")
                calls = _calls(bed)
                if seconds > 30:
                    problem = f"took {seconds:.0f} s: the head's wait was not cut short"
                elif not reason.startswith("local:vllm-n1.service: ") or "\x1b" in printed:
                    problem = f"the rank's own cause is not first: {reason[:140]!r}"
                elif code not in (1, 5) or data.get("result") not in ("rolled-back", "rollback-failed"):
                    problem = f"{data.get('result')}, exit {code}"
                elif {s for st, s, *_ in calls if st == "restore"} != {"vllm-n0.service", "vllm-n1.service"}:
                    problem = "not every node was put back"
            tally.add(f"{name}, rollback {'serves' if back_ok else 'fails too'}", problem)
    # a rank that is only not up yet (active, no failure) while the head starts is no failure
    slow = {
        "json": {
            "wire": WIRE_VERSION,
            "service": "vllm-n1.service",
            "ok": False,
            "active_state": "activating",
            "reason": "not active yet",
        }
    }
    head = {"json": _walk()["start vllm-n0.service"]["json"], "sleep": 4}
    bed = _node_bed(_walk(**{"start vllm-n0.service": head}))
    answers = json.loads((bed / "answers.json").read_text())
    answers["check vllm-n1.service"] = slow  # during the head's start; the final check then passes
    (bed / "answers.json").write_text(json.dumps(answers))

    def slow_then_up(bed: Path = bed) -> Any:
        import threading

        def settle() -> None:
            time.sleep(3.5)
            done = json.loads((bed / "answers.json").read_text())
            done["check vllm-n1.service"] = _walk()["check vllm-n1.service"]
            (bed / "answers.json").write_text(json.dumps(done))

        threading.Thread(target=settle, daemon=True).start()
        return _cli(bed, *CHANGE)

    outcome = isolated(slow_then_up, 60)
    problem = outcome_problem(outcome)
    if problem is None and (outcome[1][0], outcome[1][1].get("result")) != (0, "applied"):
        problem = f"a slow rank failed the change: {outcome[1][1].get('reason', '')[:120]!r}"
    tally.add("a rank slow to come up", problem)
    return tally.report()


def campaign_way_forward(args: argparse.Namespace) -> int:
    """Item 16 on the stand-in bed: `deployment rollback` goes before the newest final change whatever
    failed attempts came after it, `--to` takes a change id or the head's revision number and refuses
    one that is not final on every node; `recover` of an interrupted change says it changed and why;
    a drifted deployment fails `deployment verify` and `set-context` reconciles it."""
    from tests.deployment.test_wire import show_answer

    tally = Tally("way-forward", args.show)
    rng = random.Random(args.seed)
    for _ in range(60):
        made, revision, context = [], 2, 8192
        for i in range(rng.randint(1, 6)):
            state = rng.choice(["final", "final", "rolled-back", "rollback-failed"])
            new = rng.choice([4096, 16384, 32768, 65536])
            made.append(
                {
                    "change": f"c{i}",
                    "revision": revision,
                    "state": state,
                    "max_model_len": new,
                    "previous_max_model_len": context,
                }
            )
            revision += rng.randint(1, 3)
            if state == "final":
                context = new
        finals = [c for c in made if c["state"] == "final"]
        to = rng.choice(
            [None, None, rng.choice(made)["change"], str(rng.choice(made)["revision"]), "c99", "1"]
        )
        head_argv = show_answer(0)["argv"]
        answers = {}
        for rank in (0, 1):
            service = f"vllm-n{rank}.service"
            argv = [w if w != "8192" else str(context) for w in show_answer(rank)["argv"]]
            answers[f"show {service}"] = {
                "json": show_answer(rank, argv=argv, deployment_changes=made, last_change=made[-1])
            }
        del head_argv
        bed = _node_bed(_walk(**answers))
        words = ["deployment", "rollback", *(["--to", to] if to else []), "--dry-run"]
        outcome = isolated(lambda bed=bed, words=words: _cli(bed, *words), args.timeout)
        problem = outcome_problem(outcome)
        if problem is None:
            code, data, _ = outcome[1]
            by_id = {c["change"]: c for c in made}
            by_rev = {str(c["revision"]): c for c in made}
            target = by_id.get(to) or by_rev.get(to) if to else (finals[-1] if finals else None)
            ok = target is not None and target["state"] == "final"
            if ok:
                want = target["max_model_len"] if to else target["previous_max_model_len"]
                if code != 0 or data.get("max_model_len") != want:
                    problem = (
                        f"exit {code}, max_model_len {data.get('max_model_len')} (want {want}): "
                        + f"{data.get('error', data.get('reason', ''))[:100]!r}"
                    )
                elif not any(
                    ("--undo" if not to else "--back-to") in a
                    for st, _s, a, _r in _calls(bed)
                    if st == "prepare"
                ):
                    problem = "the nodes were not asked to go back to it"
            elif (
                code != 2 or "\n" in data.get("error", "x\n").strip() or "unexpected" in data.get("error", "")
            ):
                problem = f"no target, yet exit {code}: {str(data)[:120]}"
        tally.add(f"history {[c['state'][0] for c in made]} --to {to}", problem)
        shutil.rmtree(bed, ignore_errors=True)

    # recover: an interrupted change on both nodes is put back, and says so
    progress = {"revision": 5, "state": "restarting", "change": "c-int"}
    last = {
        "change": "c-int",
        "revision": 5,
        "state": "restarting",
        "max_model_len": 16384,
        "previous_max_model_len": 8192,
    }
    bed = _node_bed(
        _walk(
            **{
                f"show vllm-n{r}.service": {"json": show_answer(r, in_progress=progress, last_change=last)}
                for r in (0, 1)
            }
        )
    )
    outcome = isolated(lambda bed=bed: _cli(bed, "deployment", "recover"), args.timeout * 2)
    problem = outcome_problem(outcome)
    if problem is None:
        code, data, _ = outcome[1]
        if (code, data.get("result"), data.get("changed")) != (
            0,
            "rolled-back",
            True,
        ) or "c-int" not in data.get("reason", ""):
            problem = (
                f"exit {code}, {data.get('result')}, changed {data.get('changed')}: {data.get('reason')!r}"
            )
    tally.add("recover an interrupted change", problem)

    # drift: node 1 left at 4096 by hand
    drifted = show_answer(1, argv=[w if w != "8192" else "4096" for w in show_answer(1)["argv"]])
    verify = {
        "json": {
            "wire": WIRE_VERSION,
            "service": "vllm-n0.service",
            "result": "ok",
            "max_model_len": 8192,
            "probe_ok": True,
        }
    }
    for words, want in (
        (("deployment", "verify"), "failed"),
        ((*CHANGE[:-1], "--dry-run"), "dry-run"),
        (CHANGE, "applied"),
    ):
        bed = _node_bed(
            _walk(**{"show vllm-n1.service": {"json": drifted}, "verify vllm-n0.service": verify})
        )
        outcome = isolated(lambda bed=bed, words=words: _cli(bed, *words), args.timeout * 2)
        problem = outcome_problem(outcome)
        if problem is None:
            code, data, _ = outcome[1]
            text = json.dumps(data)
            if data.get("result") != want or "max_model_len differs between nodes" not in text:
                problem = f"exit {code}, {data.get('result')}: {text[:160]}"
            elif want == "failed" and code != 2:
                problem = f"a drifted deployment's verify exits {code}, not 2 (failed)"
            elif want == "applied" and _written(bed) != {"vllm-n0.service", "vllm-n1.service"}:
                problem = "not every node was written to the target"
        tally.add(f"drifted: {' '.join(words[:2])}", problem)
    return tally.report()


SECTIONS = {
    "textfile": campaign_textfile,
    "journal": campaign_journal,
    "state-full": campaign_state_full,
    "exit-codes": campaign_exit_codes,
    "controls": campaign_controls,
    "hosts": campaign_hosts,
    "gpus-from": campaign_gpus_from,
    "collection": campaign_collection,
    "wire-flags": campaign_wire_flags,
    "node-answers": campaign_node_answers,
    "worker-fails": campaign_worker_fails,
    "way-forward": campaign_way_forward,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=[], help=", ".join(SECTIONS))
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--show", type=int, default=5, help="failures printed per section")
    parser.add_argument("--inner-full", default=None, help=argparse.SUPPRESS)  # state-full's own namespace
    args = parser.parse_args()
    if args.inner_full:
        print(json.dumps(_full_trials(Path(args.inner_full), args.seed)))
        return
    run_sections(parser, SECTIONS, WORK, args)


if __name__ == "__main__":
    main()
