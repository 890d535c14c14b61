"""Hostile-input campaigns of issue 16 (round two): state-dir attacks, key sources x commands, vLLM's
--config YAML, `observe --import` records, container paths. Each trial runs in a forked child with a
timeout; each section prints `tried` and `failed` (an unhandled exception, a hang, an error of more
than one line, a victim file changed, a planted value read, a key printed or stored, a wrong probe
key, garbage accepted, or a container path that differs from what the container's kernel resolves).

    .venv/bin/python benchmarks/campaign_hardening.py [SECTION ...] [--seed 16] [--timeout 10] [--show 5]

SECTION: state-dir, keys, yaml, imports, container-paths, haproxy (default: all). The state-dir section needs
root (it gives files to another uid); container-paths needs `unshare -m` and bind mounts (root): its
oracle is a real mount namespace built as docker builds the container's, resolved in a chroot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


WORK = REPO / ".cache" / "campaign-hardening" / str(os.getpid())  # one run's own: runs may overlap
NOBODY = 65534
MODEL = REPO / "examples" / "models" / "qwen3-32b"
OFFLINE = ["--gpu-memory", "80G", "--gpu-count", "1", "--gpu-name", "NVIDIA H100 80GB HBM3"]


# ---- running one trial ------------------------------------------------------------------------


from trials import Tally, isolated, outcome_problem, run_sections  # noqa: E402  (benchmarks/trials.py)

# ---- state-dir attacks ------------------------------------------------------------------------


UNIT = b"[Service]\nExecStart=/opt/vllm/bin/vllm serve /models/m --max-model-len 8192\n"
PLANTED = "PLANTED-BY-ANOTHER-USER"


def _fresh_store(directory: Path) -> Any:
    from vllm_ctxmgr.store import Revision, ServiceStore, State

    store = ServiceStore(directory / "state", "vllm-x")
    store.new_revision(
        Revision(
            0, "vllm-x", State.BASELINE, "/etc/systemd/system/vllm-x.service", time.time(), plan={"a": 1}
        ),
        unit=UNIT,
        previous=UNIT,
    )
    store.add_observation({"num_gpu_blocks": 1})
    store.write_json("last-verify.json", {"result": "ok"})
    with store.lock():
        pass
    return store


def _victim(directory: Path) -> tuple[Path, Path]:
    victims = directory / "victims"
    victims.mkdir()
    (victims / "file").write_text("two\nlines\n")
    (victims / "file").chmod(0o644)
    planted = victims / "dir"
    planted.mkdir(mode=0o755)
    record = {"number": 1, "service": "vllm-x", "state": "baseline", "unit_path": PLANTED, "created": 1.0}
    (planted / "record.json").write_text(json.dumps(record))
    (planted / "unit").write_text(f"[Service]\nExecStartPre=/bin/echo {PLANTED}\n")
    (planted / "observations.jsonl").write_text(json.dumps({"note": PLANTED}) + "\n")
    return victims / "file", planted


def _snapshot(root: Path) -> list[tuple[str, int, int, bytes]]:
    out = []
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out.append((str(path), st.st_mode, st.st_uid, path.read_bytes() if path.is_file() else b""))
    return out


def _attacks() -> list[tuple[str, Callable[[Any, Path, Path], None]]]:
    """(name, apply(store, victim_file, victim_dir))."""
    places = {
        "state": lambda s: s.root.parent,
        "service": lambda s: s.root,
        "revisions": lambda s: s.revisions_dir,
        "revision": lambda s: s.revisions_dir / "0000",
        "record.json": lambda s: s.revisions_dir / "0000" / "record.json",
        "plan.json": lambda s: s.revisions_dir / "0000" / "plan.json",
        "unit": lambda s: s.revisions_dir / "0000" / "unit",
        "previous": lambda s: s.revisions_dir / "0000" / "previous",
        "lock": lambda s: s.root / "lock",
        "observations.jsonl": lambda s: s.root / "observations.jsonl",
        "last-verify.json": lambda s: s.root / "last-verify.json",
    }
    dirs = ("state", "service", "revisions", "revision")
    attacks: list[tuple[str, Callable[[Any, Path, Path], None]]] = []
    for name, where in places.items():
        for mode in (0o777, 0o775, 0o757) if name in dirs else (0o666, 0o664, 0o646):

            def chmod(
                s: Any, f: Path, d: Path, w: Callable[[Any], Path] = where, m: int = mode, n: str = name
            ) -> None:
                _plant(s, n)  # what another user who may write there would have put there
                w(s).chmod(m)

            attacks.append((f"chmod {mode:o} {name}", chmod))

        def chown(s: Any, f: Path, d: Path, w: Callable[[Any], Path] = where, n: str = name) -> None:
            _plant(s, n)
            os.chown(w(s), NOBODY, NOBODY)

        attacks.append((f"chown nobody {name}", chown))
        if name == "state":
            continue  # the operator names the state dir itself (a link there is theirs)

        def link(
            s: Any, f: Path, d: Path, w: Callable[[Any], Path] = where, to_dir: bool = name in dirs
        ) -> None:
            path = w(s)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            path.symlink_to(d if to_dir else f)

        attacks.append((f"symlink {name}", link))
        if name in dirs:
            continue

        def fifo(s: Any, f: Path, d: Path, w: Callable[[Any], Path] = where) -> None:
            w(s).unlink()
            os.mkfifo(w(s), 0o600)

        def hardlink(s: Any, f: Path, d: Path, w: Callable[[Any], Path] = where) -> None:
            w(s).unlink()
            os.link(f, w(s))

        attacks += [(f"fifo {name}", fifo), (f"hardlink {name}", hardlink)]
    return attacks


def _plant(store: Any, place: str) -> None:
    """What a user who may write `place` plants there: a revision whose unit runs their command, a
    record pointing elsewhere, a poisoned observation, a forged lock line or verification."""
    zero = store.revisions_dir / "0000"
    record = json.loads((zero / "record.json").read_text())
    if place in ("state", "service", "revisions"):
        planted = store.revisions_dir / "0009"
        planted.mkdir(mode=0o700)
        (planted / "record.json").write_text(json.dumps({**record, "number": 9, "unit_path": PLANTED}))
        (planted / "unit").write_text(f"[Service]\nExecStartPre=/bin/echo {PLANTED}\n")
    if place in ("state", "service", "observations.jsonl"):
        with (store.root / "observations.jsonl").open("a") as handle:
            handle.write(json.dumps({"note": PLANTED}) + "\n")
    if place in ("revision", "record.json"):
        (zero / "record.json").write_text(json.dumps({**record, "unit_path": PLANTED}))
    if place in ("revision", "unit", "previous", "plan.json"):
        name = "unit" if place == "revision" else place
        (zero / name).write_text(json.dumps({"x": PLANTED}) if name == "plan.json" else f"# {PLANTED}\n")
    if place in ("service", "last-verify.json"):
        (store.root / "last-verify.json").write_text(json.dumps({"result": PLANTED}))
    if place in ("service", "lock"):
        (store.root / "lock").write_text(f"pid 1: {PLANTED}\n")


# Which store operations go through which directory: there an untrusted one must be refused
_ALL_OPS = "*"
_TOUCHES: dict[str, object] = {
    "state": _ALL_OPS,
    "service": _ALL_OPS,
    "revisions": {"revisions", "file_bytes", "previous", "file_changes", "lock", "new_revision", "save",
                  "prune", "remove_partial", "in_progress", "ensure"},
    "revision": {"revisions", "file_bytes", "previous", "file_changes", "new_revision", "save", "prune",
                 "remove_partial", "in_progress"},
}  # fmt: skip


def _must_refuse(attack: str, op: str) -> bool:
    kind, _, place = attack.rpartition(" ")
    touched = _TOUCHES.get(place, set())
    return kind.split()[0] in ("chmod", "chown") and (touched == _ALL_OPS or op in touched)  # type: ignore[operator]


def _store_ops() -> dict[str, Callable[[Any], Any]]:
    from vllm_ctxmgr.store import Revision, State

    def lock(s: Any) -> None:
        with s.lock():
            pass

    def read_lock(s: Any) -> None:
        with s.read_lock():
            pass

    def new_revision(s: Any) -> int:
        rev = Revision(0, "vllm-x", State.RECORDED, "/etc/systemd/system/vllm-x.service", 1.0, plan={"b": 2})
        return s.new_revision(rev, UNIT, UNIT).number

    def save(s: Any) -> None:
        s.save(Revision(0, "vllm-x", State.BASELINE, "/etc/systemd/system/vllm-x.service", 1.0))

    return {
        "revisions": lambda s: [r.to_json() for r in s.revisions()],
        "file_bytes": lambda s: s.file_bytes(0, "unit"),
        "previous": lambda s: s.file_bytes(0, "previous"),
        "file_changes": lambda s: s.file_changes(s.get(0)),
        "lock": lock,
        "read_lock": read_lock,
        "add_observation": lambda s: s.add_observation({"num_gpu_blocks": 2}),
        "observations": lambda s: s.observations(),
        "write_json": lambda s: s.write_json("last-verify.json", {"result": "degraded"}),
        "read_json": lambda s: s.read_json("last-verify.json"),
        "new_revision": new_revision,
        "save": save,
        "prune": lambda s: s.prune(),
        "remove_partial": lambda s: s.remove_partial(),
        "lock_holder_line": lambda s: s.lock_holder_line(),
        "in_progress": lambda s: s.in_progress(),
        "ensure": lambda s: s.ensure(),
    }


def campaign_state_dir(args: argparse.Namespace) -> int:
    tally = Tally("state-dir", args.show)
    if os.geteuid() != 0:
        print("state-dir: needs root (it gives files to another uid); skipped")
        return 0
    ops = _store_ops()
    for attack_name, attack in _attacks():
        for op_name, op in ops.items():
            directory = WORK / "state" / uuid.uuid4().hex[:10]
            directory.mkdir(parents=True)
            store = _fresh_store(directory)
            victim_file, victim_dir = _victim(directory)
            attack(store, victim_file, victim_dir)
            before = _snapshot(directory / "victims")
            outcome = isolated(lambda op=op, store=store: op(store), args.timeout)
            problem = outcome_problem(outcome)
            if problem is None and _snapshot(directory / "victims") != before:
                problem = f"the victim changed ({outcome[0]})"
            if problem is None and outcome[0] == "ok" and PLANTED in repr(outcome[1]):
                problem = "a planted value was read"
            if problem is None and outcome[0] == "ok" and _must_refuse(attack_name, op_name):
                problem = "used a directory another user can change (StrictModes refuses it)"
            tally.add(f"{attack_name} x {op_name}", problem)
            with contextlib.suppress(OSError):
                shutil.rmtree(directory)
    return tally.report()


# ---- key sources x commands -------------------------------------------------------------------

K = ["sk-src-one-1111", "sk-src-two-2222", "sk-src-env-3333", "sk-src-yaml-4444", "sk-src-yaml-5555"]
DOCKER = "/usr/bin/docker run --rm --gpus all -v {model}:/models/m {opts} vllm/vllm-openai:v0.11.0 "
DOCKER += "--model /models/m"
VLLM = "/opt/vllm/bin/vllm serve {model} --port 8000"


def _key_sources(directory: Path) -> list[tuple[str, str, str, str | None, set[str]]]:
    """(name, ExecStart, extra unit lines, YAML text, the keys vLLM accepts)."""
    env_file = directory / "vllm.env"
    env_file.write_text(f"VLLM_API_KEY={K[2]}\n")
    docker_env = directory / "docker.env"
    docker_env.write_text(f"# keys\nVLLM_API_KEY={K[2]}\n")
    yaml_path = directory / "k.yaml"
    native, docker = VLLM.format(model=MODEL), DOCKER.format(model=MODEL, opts="{opts}")
    cfg, yml, env = (
        f"/opt/vllm/bin/vllm serve --config {yaml_path}",
        f"model: {MODEL}\napi-key: ",
        "VLLM_API_KEY",
    )
    return [
        ("two --api-key", f"{native} --api-key {K[0]} --api-key {K[1]}", "", None, {K[1]}),
        ("nargs", f"{native} --api-key {K[0]} {K[1]}", "", None, {K[0], K[1]}),
        ("--api-key= then flag", f"{native} --api-key={K[0]} --api-key {K[1]}", "", None, {K[1]}),
        ("--api_key", f"{native} --api_key {K[0]}", "", None, {K[0]}),
        ("--api-k abbrev", f"{native} --api-k {K[0]}", "", None, {K[0]}),
        ("Environment=", native, f"Environment=VLLM_API_KEY={K[2]}\n", None, {K[2]}),
        ("EnvironmentFile=", native, f"EnvironmentFile={env_file}\n", None, {K[2]}),
        ("env + flag", f"{native} --api-key {K[0]}", f"Environment=VLLM_API_KEY={K[2]}\n", None, {K[0]}),
        ("yaml", cfg, "", f"{yml}{K[3]}\n", {K[3]}),
        ("yaml list", cfg, "", f"{yml}[{K[3]}, {K[4]}]\n", {K[3], K[4]}),
        ("yaml + cli", f"{cfg} --api-key {K[0]}", "", f"{yml}{K[3]}\n", {K[0]}),
        ("yaml + cli x2", f"{cfg} --api-key {K[0]} --api-key {K[1]}", "", f"{yml}{K[3]}\n", {K[1]}),
        ("docker -e K=V", docker.format(opts=f"-e VLLM_API_KEY={K[2]}"), "", None, {K[2]}),
        ("docker -eK=V", docker.format(opts=f"-eVLLM_API_KEY={K[2]}"), "", None, {K[2]}),
        ("docker --env=K=V", docker.format(opts=f"--env=VLLM_API_KEY={K[2]}"), "", None, {K[2]}),
        ("docker -e twice", docker.format(opts=f"-e {env}={K[0]} -e {env}={K[2]}"), "", None, {K[2]}),
        ("docker --env K", docker.format(opts=f"--env {env}"), f"Environment={env}={K[2]}\n", None, {K[2]}),
        ("docker --env-file", docker.format(opts=f"--env-file {docker_env}"), "", None, {K[2]}),
        ("docker --env-file + -e", docker.format(opts=f"--env-file={docker_env} -e VLLM_API_KEY={K[0]}"), "",
         None, {K[0]}),
        ("docker unit env only", docker.format(opts=""), f"Environment=VLLM_API_KEY={K[2]}\n", None, set()),
        ("docker --api-key x2", docker.format(opts="") + f" --api-key {K[0]} --api-key {K[1]}", "", None,
         {K[1]}),
    ]  # fmt: skip


def _key_commands(unit_path: Path, state: Path) -> dict[str, Callable[[], str]]:
    """Each returns everything the command printed or stored (a key must appear in none of it)."""

    def plan(fmt: list[str]) -> str:
        from click.testing import CliRunner

        from vllm_ctxmgr.cli.main import main

        result = CliRunner().invoke(main, ["plan", "8192", "--unit", str(unit_path), *OFFLINE, *fmt])
        if result.exit_code not in (0, 3):
            raise RuntimeError(f"plan exit {result.exit_code}: {result.output[-200:]}")
        return result.output

    def view() -> Any:
        from vllm_ctxmgr.systemd.service import view_from_unit
        from vllm_ctxmgr.systemd.unit_file import ServiceUnit

        return view_from_unit(ServiceUnit.load_with_dropins(unit_path))

    def diff() -> str:
        from vllm_ctxmgr.masking import scrub
        from vllm_ctxmgr.systemd.unit_edit import edit_unit, unified_diff
        from vllm_ctxmgr.systemd.unit_file import ServiceUnit

        v = view()
        edit = edit_unit(ServiceUnit.load_with_dropins(unit_path), {"--max-model-len": "4096"})
        return scrub(unified_diff(edit.old_text, edit.new_text, str(edit.path), v.secrets))

    def stored() -> str:
        from vllm_ctxmgr.store import Revision, ServiceStore, State

        v = view()
        store = ServiceStore(state, "vllm-keys")
        plan_json = {"notes": list(v.args.notes), "argv": v.vllm_argv, "key": v.api_key}
        rev = Revision(
            0, "vllm-keys", State.RECORDED, str(unit_path), 1.0, reason=" ".join(v.vllm_argv), plan=plan_json
        )
        number = store.new_revision(rev, unit=unit_path.read_bytes(), previous=None).number
        store.add_observation({"argv": v.vllm_argv})
        store.write_json("last-verify.json", {"reasons": v.vllm_argv})
        directory = store.revisions_dir / f"{number:04d}"
        texts = [(directory / name).read_text() for name in ("record.json", "plan.json")]
        texts += [(store.root / name).read_text() for name in ("observations.jsonl", "last-verify.json")]
        assert (directory / "unit").read_bytes() == unit_path.read_bytes(), (
            "the unit copy must stay byte for byte"
        )
        return "\n".join(texts)

    def journal() -> str:
        from vllm_ctxmgr.masking import scrub, scrub_json
        from vllm_ctxmgr.systemd.log import journal_fields

        v = view()
        return json.dumps(scrub_json(journal_fields(scrub(" ".join(v.vllm_argv)), 6, {"ARGV": v.vllm_argv})))

    return {"plan text": lambda: plan([]), "plan --json": lambda: plan(["--json"]), "diff": diff,
            "store": stored, "journal": journal}  # fmt: skip


def campaign_keys(args: argparse.Namespace) -> int:
    tally = Tally("keys", args.show)
    (WORK / "keys" / "sources").mkdir(parents=True, exist_ok=True)
    for name, exec_start, extra, yaml_text, accepted in _key_sources(WORK / "keys" / "sources"):
        directory = WORK / "keys" / uuid.uuid4().hex[:10]
        directory.mkdir(parents=True)
        if yaml_text is not None:
            (WORK / "keys" / "sources" / "k.yaml").write_text(yaml_text)
        unit_path = directory / "vllm-keys.service"
        unit_path.write_text(f"[Service]\n{extra}ExecStart={exec_start}\n")

        def probe_key(path: Path = unit_path) -> str | None:
            from vllm_ctxmgr.systemd.service import view_from_unit
            from vllm_ctxmgr.systemd.unit_file import ServiceUnit

            return view_from_unit(ServiceUnit.load_with_dropins(path)).api_key

        outcome = isolated(probe_key, args.timeout)
        problem = outcome_problem(outcome) or (None if outcome[0] == "ok" else f"refused: {outcome[1]}")
        if problem is None and (outcome[1] in accepted if accepted else outcome[1] is None) is False:
            problem = f"the probe key is {outcome[1]!r}, vLLM accepts {sorted(accepted) or 'no key'}"
        tally.add(f"{name} x probe key", problem)
        for command, run in _key_commands(unit_path, directory / "state").items():
            outcome = isolated(run, args.timeout)
            problem = outcome_problem(outcome) or (None if outcome[0] == "ok" else f"refused: {outcome[1]}")
            leaked = [key for key in K if problem is None and key in str(outcome[1])]
            tally.add(f"{name} x {command}", problem or (f"leaked {leaked}" if leaked else None))
    return tally.report()


# ---- vLLM's --config YAML ---------------------------------------------------------------------

HOSTILE: list[Any] = [
    0, -1, 1, 7, 16, -(2**63), 2**63, 10**30, "1e308", ".inf", "-.inf", ".nan", 0.5, 1.5, "true", "false",
    "null", "''", "auto", "banana", "[]", "[1, 2]", "{}", "{a: 1}", "'x' ", "-5k", "20g", "1T", "1.5K",
]  # fmt: skip
READ_KEYS = [
    "block-size", "block_size", "kv-cache-memory-bytes", "max-model-len", "max_model_len",
    "gpu-memory-utilization", "tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size",
    "decode-context-parallel-size", "max-num-seqs", "max-num-batched-tokens", "kv-cache-dtype",
    "served-model-name", "port", "speculative-config",
]  # fmt: skip
SECRET = "sk-yaml-campaign-9999"


def _laughs(levels: int, width: int) -> str:
    lines = ['a0: &a0 "lol"'] + [
        f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)
    ]
    return "\n".join(lines) + "\n"


def _yaml_docs(rng: random.Random) -> list[tuple[str, str]]:
    head = f"model: {MODEL}\napi-key: {SECRET}\n"
    docs = [(f"laughs {lv}x{w}", head + _laughs(lv, w)) for lv in (3, 6, 9, 12) for w in (2, 5, 9, 16)]
    docs += [(f"flow depth {d}", head + "x: " + "[" * d + "]" * d + "\n") for d in (10, 63, 65, 1000, 50_000)]
    docs += [(f"map depth {d}", head + "x: " + "{a: " * d + "1" + "}" * d + "\n") for d in (10, 65, 5000)]
    docs += [(f"block depth {d}", head + "".join(f"{'  ' * i}k{i}:\n" for i in range(d)) + "  " * d + "v\n")
             for d in (20, 70, 400)]  # fmt: skip
    docs += [
        ("cycle list", head + "x: &l [1, *l]\n"),
        ("cycle map", head + "x: &m {a: *m}\n"),
        (
            "merge bomb",
            head
            + "a: &a {k: v}\n"
            + "".join(
                f"b{i}: &b{i} {{<<: *{'a' if i == 0 else f'b{i - 1}'}, x{i}: 1}}\n" for i in range(200)
            ),
        ),
        ("python tag", head + "x: !!python/object/apply:os.system ['true']\n"),
        ("binary", head + "x: !!binary aGVsbG8=\n"),
        ("not utf-8", None),  # written as bytes below
        ("list at top", "- a\n- b\n"),
        ("scalar at top", "just text\n"),
        ("empty", ""),
        ("two docs", head + "---\nmodel: other\n"),
        ("tab indent", head + "x:\n\t- 1\n"),
    ]  # type: ignore[list-item]
    docs += [
        (f"int of {n} digits", head + f"max-num-seqs: {'9' * n}\n") for n in (10, 31, 4300, 5000, 100_000)
    ]
    docs += [(f"{key}: {value}", head + f"{key}: {value}\n") for key in READ_KEYS for value in HOSTILE]
    docs += [
        (f"key {key!r}", head + f"{key}: 1\n")
        for key in ("'rm -rf /'", "'--model'", "1", "'a;b'", "'x y'", "''", "'é'", "[1]", "'.'")
    ]
    rng.shuffle(docs)
    return docs  # type: ignore[return-value]


def _multiple_of_16(n: int) -> bool:
    return 0 < n <= 4096 and n % 16 == 0


def _sane(view: Any) -> str | None:
    a = view.args
    checks = [
        (a.block_size is None or a.block_size in (1, 8) or _multiple_of_16(a.block_size),
         "block_size"),
        (a.max_model_len is None or a.max_model_len == -1 or 0 < a.max_model_len <= 1 << 32, "max_model_len"),
        (a.gpu_memory_utilization is None or 0 < a.gpu_memory_utilization <= 1, "gpu_memory_utilization"),
        (a.kv_cache_memory_bytes is None or 0 < a.kv_cache_memory_bytes <= 1 << 50, "kv_cache_memory_bytes"),
        (all(1 <= n <= 1024 for n in (a.tensor_parallel_size, a.pipeline_parallel_size, a.data_parallel_size,
                                      a.decode_context_parallel_size)), "parallel sizes"),
        (all(n is None or 1 <= n <= 1 << 24 for n in (a.max_num_seqs, a.max_num_batched_tokens)), "counts"),
    ]  # fmt: skip
    bad = [name for ok, name in checks if not ok]
    return f"garbage accepted: {bad}" if bad else None


def campaign_yaml(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile

    tally = Tally("yaml", args.show)
    root = WORK / "yaml" / uuid.uuid4().hex[:10]
    (root / "etc" / "vllm").mkdir(parents=True)
    slowest = 0.0
    for label, text in _yaml_docs(random.Random(args.seed)):
        path = root / "etc" / "vllm" / "c.yaml"
        path.write_bytes(b"model: \xff\xfe\n" if text is None else text.encode())
        exec_start = "/opt/vllm/bin/vllm serve --config /etc/vllm/c.yaml"
        unit_file = UnitFile.parse("/etc/systemd/system/t.service", f"[Service]\nExecStart={exec_start}\n")
        unit = ServiceUnit("t.service", (unit_file,))

        def load(unit: ServiceUnit = unit) -> Any:
            from vllm_ctxmgr.systemd.service import view_from_unit

            view = view_from_unit(unit, root)
            return (_sane(view), view.api_key)

        started = time.perf_counter()
        outcome = isolated(load, args.timeout)
        slowest = max(slowest, time.perf_counter() - started)
        problem = outcome_problem(outcome)
        if problem is None and outcome[0] == "refused" and SECRET in outcome[1]:
            problem = "the refusal echoes a value of the file (its key)"
        if problem is None and outcome[0] == "ok":
            problem = outcome[1][0]
        tally.add(label[:60], problem)
    failed = tally.report()
    print(f"{'':<16} slowest document {slowest:.2f} s (fork included)")
    return failed


# ---- observe --import -------------------------------------------------------------------------

GOOD = {
    "vllm_version": "0.33.0", "platform": "GPU", "gpu_name": "NVIDIA H100 80GB HBM3", "host": "gpu-01",
    "service": "vllm-x", "ready": True, "failure": None, "total_memory_gib": 79.2, "model_loading_gib": 61.0,
    "available_kv_gib": 8.1, "cuda_graph_gib": 0.5, "num_gpu_blocks": 2000, "block_size": 16,
    "kv_cache_tokens": 32000, "max_model_len": 8192, "gpu_memory_utilization": 0.9, "time": 1767000000.5,
    "configured_max_model_len": 8192, "configured_gpu_memory_utilization": 0.9,
}  # fmt: skip
IMPORT_HOSTILE: list[Any] = [
    0, -1, 1, 2**31, 2**63, 10**400, 1e308, -1e308, 1e-308, 0.5, 1.5, True, False, None, "", "x\ny",
    "\x1b[2J", "a" * 5000, [], [1], {}, {"a": 1}, "0.33.0", "999.0", "NVIDIA A100-SXM4-80GB",
    "kv_cache_too_small",
]  # fmt: skip


def _import_texts(rng: random.Random) -> list[tuple[str, str]]:
    texts = [
        (f"{key}={value!r:.30}", json.dumps({**GOOD, key: value})) for key in GOOD for value in IMPORT_HOSTILE
    ]
    texts += [
        ("deep list", "[" * 100_000 + "]" * 100_000),
        ("deep record", '{"record": ' * 50_000 + "{}" + "}" * 50_000),
        ("NaN", json.dumps(GOOD).replace("79.2", "NaN")),
        ("Infinity", json.dumps(GOOD).replace("79.2", "Infinity")),
        ("5000 digits", json.dumps(GOOD).replace("2000", "9" * 5000)),
        ("not json", "not json"),
        ("array", "[]"),
        ("big", json.dumps({**GOOD, "pad": "x" * (2 << 20)})),
        ("whole observe --json", json.dumps({"command": "observe", "record": GOOD})),
        ("failed start", json.dumps({**GOOD, "failure": "kv_cache_too_small", "estimated_max_model_len": 1})),
        ("kv > total", json.dumps({**GOOD, "available_kv_gib": 80.0})),
    ]
    rng.shuffle(texts)
    return texts


def _record_sane(record: dict[str, Any]) -> str | None:
    for key, value in record.items():
        if isinstance(value, float) and not (math.isfinite(value) and 0 <= value <= 1e13):
            return f"{key}={value!r}"
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 1 << 40:
            return f"{key}={value!r:.30}"
        if isinstance(value, str) and (not value.isprintable() or len(value) > 300):
            return f"{key} not printable text"
    if record.get("failure"):
        return "a failed start's record"
    return None


def campaign_imports(args: argparse.Namespace) -> int:
    from vllm_ctxmgr import files
    from vllm_ctxmgr.change.planning import MAX_IMPORT_BYTES, imported_observation
    from vllm_ctxmgr.errors import UsageError

    tally = Tally("imports", args.show)
    directory = WORK / "imports" / uuid.uuid4().hex[:10]
    directory.mkdir(parents=True)
    match = {"service": "vllm-x", "vllm_version": "0.33.0", "gpu_names": ["NVIDIA H100 80GB HBM3"]}

    def through_door(path: str) -> Any:
        raw = files.read_regular(path, MAX_IMPORT_BYTES, what="observation", error=UsageError)
        record = imported_observation(raw.decode(errors="replace"), path, **match)  # type: ignore[arg-type]
        problem = _record_sane(record)
        if problem is None:
            from vllm_ctxmgr.change.planning import PlanRequest, observations_from_store, plan_for
            from vllm_ctxmgr.core.serve_args import ServeArgs

            request = PlanRequest(8192, gpu_memory=80 << 30, gpu_count=1, gpu_name="NVIDIA H100 80GB HBM3")
            plan_for(
                ServeArgs(model=str(MODEL), vllm_version="0.33.0"),
                request,
                (),
                observations_from_store([record]),
            )
        return problem

    for label, text in _import_texts(random.Random(args.seed)):
        path = directory / f"{uuid.uuid4().hex[:8]}.json"
        path.write_text(text)
        outcome = isolated(lambda p=str(path): through_door(p), args.timeout)
        problem = outcome_problem(outcome) or (outcome[1] if outcome[0] == "ok" else None)
        tally.add(label, problem)
    fifo = directory / "fifo.json"
    os.mkfifo(fifo)
    for label, path in (("fifo", str(fifo)), ("/dev/zero", "/dev/zero"), ("directory", str(directory))):
        outcome = isolated(lambda p=path: through_door(p), args.timeout)
        tally.add(label, outcome_problem(outcome) or (None if outcome[0] == "refused" else "accepted"))
    return tally.report()


# ---- container paths against a real mount namespace ----------------------------------------------

ORACLE = r"""
import json, os, sys
spec = json.loads(sys.argv[1])
rootfs = spec["rootfs"]
for source, target, tmpfs in spec["mounts"]:  # docker's order: parents first, later on top
    where = rootfs + target
    os.makedirs(where, exist_ok=True)
    if tmpfs:
        os.system(f"mount -t tmpfs none '{where}'")
    else:
        os.system(f"mount --bind '{source}' '{where}'")
os.chroot(rootfs)
out = []
for path in spec["paths"]:
    try:
        st = os.stat(path)
        out.append([st.st_dev, st.st_ino])
    except OSError:
        out.append(None)
print(json.dumps(out))
"""

MOUNT_CHOICES = [("a", "/models", False), ("b", "/models/big", False), ("c", "/data", False),
                 ("b", "/models", False), ("", "/models/cache", True), ("", "/models", True),
                 ("c", "/models/big/deeper", False)]  # fmt: skip
LINK_TARGETS = [
    "/models/m1",
    "/data/x",
    "/etc",
    "/",
    "../m1",
    "../../etc",
    "..",
    ".",
    "m1",
    "/models/big",
    "/models/../data/x",
    "../../../../../data",
    "loop",
    "/models/cache/z",
    "/missing",
]
PATH_PARTS = ["m1", "m2", "x", "f", "l0", "l1", "l2", "..", ".", "big", "cache", "deeper", "missing"]


def _container_tree(host: Path, rng: random.Random) -> None:
    for volume in ("a", "b", "c"):
        for sub in ("m1", "m2", "x", "big", "deeper"):
            (host / volume / sub).mkdir(parents=True, exist_ok=True)
            (host / volume / sub / "f").write_text(volume + sub)
        (host / volume / "f").write_text(volume)
        for i in range(3):
            target = rng.choice(LINK_TARGETS)
            where = host / volume / rng.choice(["", "m1", "x"]) / f"l{i}"
            with contextlib.suppress(FileExistsError):
                where.symlink_to(where.name if target == "loop" else target)


def campaign_container_paths(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.errors import UnitError
    from vllm_ctxmgr.systemd.vllm_command import ContainerVolume, host_path

    tally = Tally("container-paths", args.show)
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("container-paths: needs root and unshare; skipped")
        return 0
    rng = random.Random(args.seed)
    refused_reachable = 0
    for scenario in range(args.scenarios):
        base = WORK / "container" / uuid.uuid4().hex[:10]
        host, rootfs = base / "host", base / "rootfs"
        _container_tree(host, rng)
        (rootfs / "etc").mkdir(parents=True)
        (rootfs / "etc" / "os-release").write_text("image\n")
        chosen = rng.sample(MOUNT_CHOICES, rng.randint(1, 4))
        mounts = [(str(host / src) if src else "", target, tmpfs) for src, target, tmpfs in chosen]
        order = sorted(range(len(mounts)), key=lambda i: (mounts[i][1].rstrip("/").count("/"), i))  # docker's
        volumes = [ContainerVolume(src, target, tmpfs=tmpfs) for src, target, tmpfs in mounts]
        paths = ["/" + "/".join(rng.choice(["models", "data", "etc"]) if i == 0 else rng.choice(PATH_PARTS)
                                for i in range(rng.randint(1, 5))) for _ in range(12)]  # fmt: skip
        spec = {"rootfs": str(rootfs), "mounts": [mounts[i] for i in order], "paths": paths}
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", ORACLE,
                               json.dumps(spec)], capture_output=True, text=True, timeout=60)  # fmt: skip
        if proc.returncode != 0:
            tally.add(f"scenario {scenario}", f"the oracle failed: {proc.stderr[-200:]}")
            continue
        seen = json.loads(proc.stdout)
        in_volumes = {
            (st.st_dev, st.st_ino) for p in host.rglob("*") if not p.is_symlink() for st in [p.stat()]
        }
        in_volumes |= {
            (st.st_dev, st.st_ino) for p in (host / "a", host / "b", host / "c") for st in [p.stat()]
        }
        for path, oracle in zip(paths, seen, strict=True):
            label = f"{path} with {[(m[1], 'tmpfs' if m[2] else Path(m[0]).name) for m in mounts]}"
            try:
                answer: str | None = host_path(path, volumes)
            except UnitError as exc:
                answer = None
                if "\n" in str(exc):
                    tally.add(label, "an error of more than one line")
                    continue
            except Exception as exc:
                tally.add(label, f"unhandled {type(exc).__name__}: {exc}")
                continue
            problem = None
            if answer is not None:
                try:
                    st = os.stat(answer)
                    here: tuple[int, int] | None = (st.st_dev, st.st_ino)
                except OSError:
                    here = None
                if here != (tuple(oracle) if oracle else None):
                    sees = "nothing" if oracle is None else "another file"
                    problem = f"ctxmgr reads {answer}, the container sees {sees}"
            elif oracle is not None and tuple(oracle) in in_volumes:
                refused_reachable += 1  # safe: ctxmgr refuses what it cannot verify (a `..` out of the image)
            tally.add(label, problem)
        shutil.rmtree(base, ignore_errors=True)
    failed = tally.report()
    print(f"{'':<16} refused though the container reaches a volume's file there (safe): {refused_reachable}")
    return failed


# ---- the HAProxy runtime client (the Ansible collection's module_utils) -------------------------------

HAP_HEADER = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,status,\n"


def _hap_behaviours() -> list[tuple[str, Callable[[Any], None]]]:
    def drip(delay: float) -> Callable[[Any], None]:
        def run(conn: Any) -> None:
            for _ in range(400):
                conn.sendall(b"#")
                time.sleep(delay)

        return run

    def endless(size: int) -> Callable[[Any], None]:
        block = (HAP_HEADER + "vllm,h1,0,0,0,5,,40,UP,\n" * 4000).encode()

        def run(conn: Any) -> None:
            for _ in range(size // len(block) + 1):
                conn.sendall(block)

        return run

    def text(body: str) -> Callable[[Any], None]:
        return lambda conn: conn.sendall(body.encode(errors="surrogateescape"))

    rows = {
        "scur abc": "vllm,h1,0,0,abc,5,,40,UP,", "scur -1": "vllm,h1,0,0,-1,5,,40,UP,",
        "scur 1e3": "vllm,h1,0,0,1e3,5,,40,UP,", "scur 10**30": "vllm,h1,0,0," + "9" * 30 + ",5,,40,UP,",
        "qcur x": "vllm,h1,x,0,0,5,,40,UP,", "short row": "vllm,h1",
        "long row": "vllm,h1," + ",".join("1" * 500), "NUL": "vllm,h1,0,0,\0,5,,40,UP,",
        "quote": 'vllm,h1,"0,0,0,5,,40,UP,', "status ??": "vllm,h1,0,0,0,5,,40,??,",
        "huge field": 'vllm,h1,"' + "x" * 300_000 + '",0,0,5,,40,UP,',
    }  # fmt: skip
    behaviours: list[tuple[str, Callable[[Any], None]]] = [
        (f"drip {d:g} s", drip(d)) for d in (0.01, 0.05, 0.2)
    ]
    behaviours += [(f"{size >> 20} MiB", endless(size)) for size in (17 << 20, 64 << 20, 300 << 20)]
    behaviours += [
        ("silent", lambda conn: time.sleep(30)), ("close", lambda conn: None),
        ("no header", text("vllm,h1,0\n")),
        ("unknown command", text("Unknown command.\n")), ("binary", text("\x00\xff" * 1000)),
    ]  # fmt: skip
    behaviours += [(name, text(HAP_HEADER + row + "\n")) for name, row in rows.items()]
    return behaviours


HAP_NAMES = [
    "h1",
    "h1; shutdown sessions server vllm/h2",
    "h 1",
    "h1\nshow info",
    "",
    "h1\tx",
    "h1/x",
    "é",
    "h" * 500,
]


def _hap_commands() -> list[tuple[str, Callable[[Any], Any]]]:
    commands: list[tuple[str, Callable[[Any], Any]]] = [
        ("servers", lambda rt: rt.servers("vllm")),
        ("wait idle", lambda rt: rt.wait("vllm", "h1", "idle", timeout=0.5, interval=0.05)),
        ("wait up", lambda rt: rt.wait("vllm", "h1", "up", timeout=0.5, interval=0.05)),
        ("set drain", lambda rt: rt.set_state("vllm", "h1", "drain")),
    ]
    for name in HAP_NAMES[1:]:
        commands.append((f"set {name[:20]!r}", lambda rt, n=name: rt.set_state("vllm", n, "drain")))
        commands.append((f"server {name[:20]!r}", lambda rt, n=name: rt.server(n, "h1")))
    return commands


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    return 0


def campaign_haproxy(args: argparse.Namespace) -> int:
    import socket
    import threading

    from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import HaproxyError, Runtime

    tally = Tally("haproxy", args.show)
    directory = WORK / "hap"
    directory.mkdir(parents=True, exist_ok=True)
    deadline_s = 2.0
    worst = (0.0, 0)
    for behaviour_name, behaviour in _hap_behaviours():
        path = str(directory / f"{uuid.uuid4().hex[:8]}.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(8)

        def serve(server: Any = server, behaviour: Callable[[Any], None] = behaviour) -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                threading.Thread(target=_hap_answer, args=(conn, behaviour), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
        for command_name, command in _hap_commands():

            def trial(command: Callable[[Any], Any] = command, path: str = path) -> Any:
                before, started = _vm("VmRSS"), time.monotonic()
                try:
                    command(Runtime(path, timeout=deadline_s))
                    result = "ok"
                except HaproxyError as exc:
                    result = "refused" if "\n" not in str(exc) else "multi-line"
                return (result, time.monotonic() - started, _vm("VmHWM") - before)

            outcome = isolated(trial, args.timeout + 30)
            problem = outcome_problem(outcome)
            if problem is None and outcome[0] == "ok":
                result, seconds, grown = outcome[1]
                worst = (max(worst[0], seconds), max(worst[1], grown))
                if result == "multi-line":
                    problem = "an error of more than one line"
                elif seconds > deadline_s + 1.5:  # wait()'s own 0.5 s on top of one command's deadline
                    problem = f"took {seconds:.1f} s against timeout={deadline_s:g}"
                elif grown > 200 << 20:
                    problem = f"memory grew {grown >> 20} MiB"
                elif result == "ok" and not _hap_may_succeed(behaviour_name, command_name):
                    problem = "garbage accepted as an answer"
            elif problem is None:
                problem = f"{outcome[0]}: {outcome[1]}"  # CtxmgrError cannot come from here
            tally.add(f"{behaviour_name} x {command_name}", problem)
        server.close()
    failed = tally.report()
    grown = worst[1] >> 20
    print(f"{'':<16} slowest call {worst[0]:.2f} s (timeout={deadline_s:g}), most memory grown {grown} MiB")
    return failed


def _hap_may_succeed(behaviour: str, command: str) -> bool:
    """Where a call may return: `servers` reads any well-formed CSV (its values are the caller's to
    judge), `wait up` needs a row saying UP, `wait idle` two valid counts, `set drain` an empty answer;
    a hostile name never reaches HAProxy."""
    bad_count = behaviour.startswith(("scur ", "qcur ")) or behaviour == "NUL"  # a counter that is no count
    if command == "servers":
        return bad_count or behaviour in ("short row", "long row", "status ??")
    if command == "wait up":
        return bad_count
    if command == "wait idle":
        return behaviour == "status ??"  # both counts are 0: idle, whatever the status word
    if command == "set drain":
        return behaviour == "close"
    return False


def _hap_answer(conn: Any, behaviour: Callable[[Any], None]) -> None:
    with conn, contextlib.suppress(OSError):
        conn.recv(4096)
        behaviour(conn)


SECTIONS = {
    "state-dir": campaign_state_dir,
    "keys": campaign_keys,
    "yaml": campaign_yaml,
    "imports": campaign_imports,
    "container-paths": campaign_container_paths,
    "haproxy": campaign_haproxy,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=[], help=", ".join(SECTIONS))
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--scenarios", type=int, default=40, help="container-path scenarios (12 paths each)")
    parser.add_argument("--show", type=int, default=5, help="failures printed per section")
    run_sections(parser, SECTIONS, WORK)


if __name__ == "__main__":
    main()
