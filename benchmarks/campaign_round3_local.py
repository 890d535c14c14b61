"""Hostile-input campaign of issue 29 (round three), the classes one host can try by itself: the
--textfile writer in a directory others may write, echoed journal lines and impossible figures, a full
state directory, exit codes of a crash and of a node, terminal controls in what a node or a journal
says, a deployment file's hosts, unbounded --gpus-from / gpus_from reads, and the collection's
parameters and HAProxy admin states. Each trial runs in a forked child with a timeout (or, where it
needs its own mount namespace or address-space limit, in a child process); each section prints
`tried` and `failed` (an unhandled exception, a hang, an error of more than one line, a victim file
changed, an echo learned, an impossible figure planned from, an OSError out of the store, an exit
code outside ctxmgr's, a control character printed, a hostile host accepted, a read without end, a
parameter dropped, or a hostile name sent).

    .venv/bin/python benchmarks/campaign_round3_local.py [SECTION ...] [--seed 29] [--timeout 20] [--show 5]

SECTION: textfile, journal, state-full, exit-codes, controls, hosts, gpus-from, collection (default:
all). textfile and state-full need root (another uid's files; `unshare -m` and a tmpfs).
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


SECTIONS = {
    "textfile": campaign_textfile,
    "journal": campaign_journal,
    "state-full": campaign_state_full,
    "exit-codes": campaign_exit_codes,
    "controls": campaign_controls,
    "hosts": campaign_hosts,
    "gpus-from": campaign_gpus_from,
    "collection": campaign_collection,
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
