"""ExecStart= as systemd executes it: comment lines inside continuations, `$VAR` / `${VAR}` expansion,
EnvironmentFile= syntax, edits read back; and the same rules checked against what a real systemd runs
(the private sandbox): units print their argv with `printf "%s\\n" "$@"` and that is compared
with quoting.py's and unit_file.py's reading."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.paths import REPO
from tests.systemd_fixtures import InstallUnit
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.systemd.quoting import exec_argv, parse_env_file, split_words
from vllm_ctxmgr.systemd.service import view_from_unit
from vllm_ctxmgr.systemd.systemctl import Systemd, cmdline_argv
from vllm_ctxmgr.systemd.unit_edit import edit_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile, read_environment_file
from vllm_ctxmgr.systemd.vllm_command import find_vllm_command, vllm_args_from_cmdline

UNITS = REPO / "units"


def unit_of(tmp_path: Path, text: str, name: str = "vllm.service") -> ServiceUnit:
    path = tmp_path / name
    path.write_text(text)
    return ServiceUnit.load(name, path)


def argv_of(unit: ServiceUnit, root: Path = Path("/")) -> list[str]:
    _, exec_start = unit.exec_start()
    return find_vllm_command(exec_start.value).argv(unit.environment(root))


# ---------------------------------------------------------------------------------------------------------
# Issue 8 item 1: EnvironmentFile= and a bare $VAR


def envfile_root(tmp_path: Path) -> Path:
    (tmp_path / "etc/default").mkdir(parents=True)
    shutil.copy(UNITS / "etc" / "default" / "vllm", tmp_path / "etc/default/vllm")
    return tmp_path


def test_bare_variable_from_an_environment_file_splits_into_flags(tmp_path: Path) -> None:
    root = envfile_root(tmp_path)
    unit = ServiceUnit.load_with_dropins(UNITS / "vllm-envfile.service")
    view = view_from_unit(unit, root)
    assert view.args.tensor_parallel_size == 4  # was 1: "-tp 4 --max-model-len ..." kept as one word
    assert view.args.max_model_len == 16384
    assert view.args.gpu_memory_utilization == pytest.approx(0.92)
    assert view.args.model == "/srv/models/Llama-3.1-70B-Instruct"
    assert view.args.port == 8011  # the EnvironmentFile= overrides Environment=VLLM_PORT=8000
    assert view.env["HF_HOME"] == "/var/lib/vllm/hf cache"
    assert view.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_required_environment_file_missing_is_an_error_optional_is_not(tmp_path: Path) -> None:
    unit = ServiceUnit.load_with_dropins(UNITS / "vllm-envfile.service")
    with pytest.raises(UnitError, match="/etc/default/vllm: no such file"):
        unit.environment(tmp_path)
    assert read_environment_file("-/etc/default/vllm.local", tmp_path) == {}


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_environment_file_reads_are_bounded(tmp_path: Path, kind: str) -> None:
    (tmp_path / "etc").mkdir()
    target = tmp_path / "etc/env"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        target.symlink_to("/dev/zero")
    else:
        target.write_bytes(b"A=" + b"x" * (2 << 20) + b"\n")
    with pytest.raises(UnitError, match=r"expected a regular file|more than the"):
        read_environment_file("/etc/env", tmp_path)


def test_environment_file_syntax_as_systemd_252_reads_it() -> None:
    # each expectation was checked against systemd 252 in the sandbox (EnvironmentFile= + env)
    text = (
        "A=plain value  \n"
        '  B = "dq \\" \\$ \\\\ \\n x" tail\n'
        "C='sq \\n $x'\n"
        "# comment ending in a backslash swallows the next line \\\n"
        "D=after-comment\n"
        "; semicolon comment\n"
        "export E=exported\n"
        "F=cont\\\ninued\n"
        'G="multi\nline"\n'
        "H=a\\ b\\\\c\n"
        "I\n"
        "J=  lead\n"
        'K="x" "y"\n'
        "bad name=1\n"
        "L=\r\n"
        "M=crlf\r\n"
    )
    assert dict(parse_env_file(text)) == {
        "A": "plain value",
        "B": 'dq " $ \\ \\n xtail',
        "C": "sq \\n $x",
        "F": "continued",
        "G": "multi\nline",
        "H": "a b\\c",
        "J": "lead",
        "K": "xy",
        "L": "",
        "M": "crlf",
    }


def test_environment_files_in_order_override_environment(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/one").write_text("A=one\nB=one\n")
    (tmp_path / "etc/two").write_text("A=two\n")
    unit = unit_of(
        tmp_path,
        "[Service]\nEnvironmentFile=/etc/one\nEnvironment=A=env B=env C=env\nEnvironmentFile=/etc/two\n"
        "UnsetEnvironment=C\nExecStart=/bin/vllm serve m\n",
    )
    assert unit.environment(tmp_path) == {"A": "two", "B": "one"}


def test_plan_unit_file_reads_its_dropins(tmp_path: Path) -> None:
    shutil.copytree(UNITS / "vllm-gemma3.service.d", tmp_path / "vllm-gemma3.service.d")
    shutil.copy(UNITS / "vllm-gemma3.service", tmp_path)
    unit = ServiceUnit.load_with_dropins(tmp_path / "vllm-gemma3.service")
    assert [f.path.name for f in unit.files] == ["vllm-gemma3.service", "override.conf"]
    assert view_from_unit(unit).args.max_model_len == 32768  # the drop-in's, not the fragment's 8192


def test_expansion_rules_of_systemd_service_5() -> None:
    words = split_words(r"$A ${A} pre$A pre${A} $$ $$A $ x$ $D ${D} $UNSET $A- ${A}${B} 100%% '$A'")
    env = {"A": "x  'y z'", "B": "b", "D": ""}
    assert exec_argv(words, env) == [
        *("x", "y z"),  # a bare $A: split at whitespace, quotes removed
        "x  'y z'",
        "pre$A",  # $A inside a word is not expanded
        "prex  'y z'",
        *("$", "$A"),
        "x$",
        "",  # $D (empty) gives no word, ${D} one empty word
        "x  'y z'b",
        "100%",
        *("x", "y z"),  # quotes are undone before expansion: '$A' is a bare $A
    ]


def test_cmdline_argv_reads_the_managers_proc(tmp_path: Path) -> None:
    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/cmdline").write_bytes(b"/usr/bin/python3\0/opt/vllm/bin/vllm\0serve\0m\0-tp\x004\0")
    systemd = Systemd(root=tmp_path)
    cmdline = cmdline_argv(systemd, 42)
    assert cmdline == ["/usr/bin/python3", "/opt/vllm/bin/vllm", "serve", "m", "-tp", "4"]
    assert vllm_args_from_cmdline(cmdline) == ["m", "-tp", "4"]
    assert cmdline_argv(systemd, 43) is None


# ---------------------------------------------------------------------------------------------------------
# Issue 9 item 2: comment lines inside an ExecStart= continuation

COMMENTED_REAL_FLAG = """\
[Service]
ExecStart=/opt/vllm/bin/vllm serve Qwen/Qwen3-8B \\
    --port 8002 \\
#    --max-model-len 8192 \\
    --max-model-len 32768
Restart=no
"""

COMMENTED_LAST_LINE = """\
[Service]
ExecStart=/opt/vllm/bin/vllm serve Qwen/Qwen3-8B \\
    --port 8002 \\
#    --max-model-len 8192
ExecStartPre=/bin/echo joined by systemd
Restart=no
"""


def test_comment_lines_inside_a_continuation_are_skipped(tmp_path: Path) -> None:
    unit = unit_of(tmp_path, COMMENTED_REAL_FLAG)
    assert argv_of(unit) == ["Qwen/Qwen3-8B", "--port", "8002", "--max-model-len", "32768"]
    assert unit.files[0].get_all("Service", "Restart")[0].value == "no"
    joined = unit_of(tmp_path, COMMENTED_LAST_LINE)
    assert argv_of(joined)[-4:] == ["ExecStartPre=/bin/echo", "joined", "by", "systemd"]
    assert joined.files[0].get_all("Service", "ExecStartPre") == []


def test_deleting_the_real_flag_leaves_the_comment_and_the_next_directive(tmp_path: Path) -> None:
    unit = unit_of(tmp_path, COMMENTED_REAL_FLAG)
    edit = edit_unit(unit, {"--max-model-len": None, "--gpu-memory-utilization": "0.9"})
    new = ServiceUnit(unit.name, (UnitFile.parse(edit.path, edit.new_text),))
    assert argv_of(new) == ["Qwen/Qwen3-8B", "--port", "8002", "--gpu-memory-utilization", "0.9"]
    assert new.files[0].get_all("Service", "Restart")[0].value == "no"
    assert "#    --max-model-len 8192 \\\n" in edit.new_text


def test_appending_after_a_commented_last_line_keeps_the_joined_line_joined(tmp_path: Path) -> None:
    unit = unit_of(tmp_path, COMMENTED_LAST_LINE)
    before = argv_of(unit)
    edit = edit_unit(unit, {"--max-model-len": "16384"})
    new = ServiceUnit(unit.name, (UnitFile.parse(edit.path, edit.new_text),))
    assert argv_of(new) == [*before, "--max-model-len", "16384"]
    assert new.files[0].get_all("Service", "ExecStartPre") == []
    assert "#    --max-model-len 8192\n" in edit.new_text


def test_the_real_commented_unit_plans_from_the_live_flag() -> None:
    unit = ServiceUnit.load_with_dropins(UNITS / "vllm-commented.service")
    args = view_from_unit(unit).args
    assert (args.max_model_len, args.max_num_seqs, args.enforce_eager) == (32768, 64, False)
    edit = edit_unit(unit, {"--max-model-len": "65536", "--enforce-eager": None})
    assert edit.new_text == edit.old_text.replace("--max-model-len 32768", "--max-model-len 65536")


# hypothesis: units whose ExecStart continuation holds comment lines anywhere; every edit must leave the
# argv systemd would run equal to the intended one, every comment and other directive as it was.

flag_lines = st.lists(
    st.sampled_from(
        [
            "--port 8002",
            "--max-model-len 8192",
            "--max-model-len=4096",
            "--gpu-memory-utilization 0.8",
            "--max-num-seqs 16 --port 8003",
            "-tp 2",
            "#    --max-model-len 1024",
            ";   --gpu-memory-utilization 0.5 \\",
            "# --max-model-len 2048 \\",
        ]
    ),
    min_size=0,
    max_size=6,
)
changes = st.fixed_dictionaries(
    {},
    optional={
        "--max-model-len": st.one_of(st.none(), st.sampled_from(["16384", "32k"])),
        "--gpu-memory-utilization": st.one_of(st.none(), st.sampled_from(["0.9", "0.95"])),
        "--max-num-seqs": st.one_of(st.none(), st.just("8")),
    },
)


def build_unit(lines: list[str], last_comment: bool) -> str:
    body = "ExecStart=/opt/vllm/bin/vllm serve m"
    for line in lines:
        body += f" \\\n{line}" if line.startswith(("#", ";")) else f" \\\n    {line}"
    tail = "\n# trailing comment" if last_comment else ""
    return f"[Unit]\nDescription=x\n\n[Service]\n{body}{tail}\nRestart=no\nTimeoutStartSec=900\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag_lines, st.booleans(), changes)
def test_edits_of_units_with_comments_in_continuations(
    tmp_path: Path, lines: list[str], last_comment: bool, change: dict[str, str | None]
) -> None:
    text = build_unit(lines, last_comment)
    old_file = UnitFile.parse("/x/vllm.service", text)
    unit = ServiceUnit("vllm.service", (old_file,))
    try:
        old_argv = argv_of(unit)
    except UnitError:
        return
    try:
        edit = edit_unit(unit, change)
    except UnitError as exc:
        assert "refusing" in str(exc) or "overlap" in str(exc)
        return
    new_file = UnitFile.parse("/x/vllm.service", edit.new_text)
    new_argv = argv_of(ServiceUnit("vllm.service", (new_file,)))
    new_args = parse_serve_argv(new_argv)
    for flag, value in change.items():
        attr = flag.lstrip("-").replace("-", "_")
        got = getattr(new_args, attr)
        if value is None:
            assert flag not in new_argv and not any(w.startswith(flag + "=") for w in new_argv)
        else:
            assert str(got) == str(getattr(parse_serve_argv(["m", flag, value]), attr))
    untouched = [w for w in old_argv if not w.startswith(tuple(change))]
    assert new_argv[0] == old_argv[0] and all(w in new_argv for w in untouched if not w[0].isdigit())
    assert [old_file.text[s:e] for s, e in old_file.comments] == [
        new_file.text[s:e] for s, e in new_file.comments
    ]
    others = [(a.key, a.value) for a in old_file.assignments if a.key != "ExecStart"]
    assert [(a.key, a.value) for a in new_file.assignments if a.key != "ExecStart"] == others


# ---------------------------------------------------------------------------------------------------------
# Against the sandbox's systemd: what it executes, compared with our reading.

# each argument on its own line, ended by `<`, into a file per command line: the journal of a process that
# has already exited can lose its first lines' unit match, a file cannot
PRINT = '/bin/sh -c \'printf "%%s<\\n" "$@" > /run/ctxmgr-argv/{tag}\' _ BEGIN'
TOKENS = [
    "a",
    "b c",
    '"q d"',
    "'s e'",
    "x\\ty",
    "\\\\",
    '\\"',
    "$A",
    "${A}",
    "pre$A",
    "pre${B}",
    "$$",
    "$$A",
    "%%",
    "100%%",
    "$UNSET",
    "${UNSET}",
    "$E",
    "${E}",
    "a\\x41",
    "'${B}'",
    '"$A"',
    "\\;",
    "$F",
    "$",
    "${A:-x}",
]
ENV_FILE = "A=\"  two  words \"\nB='b  \"q\"'\nE=\nF=from-file 'x y'\n"
word_lists = st.lists(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=8), min_size=8, max_size=8)


def test_systemd_runs_the_argv_we_read(
    sandbox_systemd: Systemd, install_unit: InstallUnit, tmp_path: Path
) -> None:
    """~30 unit starts, 8 command lines each: hypothesis picks the words, systemd says what it ran."""
    systemd = sandbox_systemd
    env_host = systemd.host_path("/run/ctxmgr-exec-test.env")
    env_host.write_text(ENV_FILE)
    starts = {"n": 0}

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(word_lists)
    def check(commands: list[list[str]]) -> None:
        starts["n"] += 1
        lines = [f"ExecStartPre={PRINT.format(tag=i)} {' '.join(words)}" for i, words in enumerate(commands)]
        text = (
            '[Service]\nType=oneshot\nEnvironment=A=env-a "B=env b" F=env-f\n'
            "EnvironmentFile=/run/ctxmgr-exec-test.env\nEnvironmentFile=-/run/no-such.env\n"
            + "\n".join(lines)
            + "\nExecStart=/bin/true\n"
        )
        install_unit("argv-check.service", text)
        out = systemd.host_path("/run/ctxmgr-argv")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        systemd.start("argv-check.service")
        printed = {
            i: [line.removesuffix("<") for line in (out / str(i)).read_text().split("\n")[:-1]]
            for i in range(len(commands))
        }
        unit_file = UnitFile.parse("/run/systemd/system/argv-check.service", text)
        unit = ServiceUnit("argv-check.service", (unit_file,))
        env = unit.environment(systemd.root)
        for i, pre in enumerate(unit_file.get_all("Service", "ExecStartPre")):
            ours = exec_argv(split_words(pre.value), env)[
                4:
            ]  # after /bin/sh -c SCRIPT _ (BEGIN: printf prints once without arguments)
            assert printed[i] == ours, (commands[i], pre.value)

    check()
    assert starts["n"] >= 20
