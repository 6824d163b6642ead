"""The README's command lines work as typed (issue 36): every `ultrascale ...` line of its bash
blocks runs from a copy of the repository's layout and exits 0, except the long ones (calibrate,
sweep) and the web server (ui), whose arguments must still parse and whose files must exist;
every `$ ultrascale ...` example of its console blocks prints what the README shows. And no file
of the repository points outside it (the design notes' folder beside a working copy), and what
the help texts cite exists.

Every command runs with the packages of requirements.txt alone (the test-only ones hidden,
tests/runtime_only/), as after the README's `pip install -r requirements.txt -e .` (issue 50).
The long ones run so elsewhere: `calibrate --quick` in tests/test_planner_calibrate.py, a sweep's
collection and report in tests/test_planner_sweep.py, the web server in tests/test_ui_api.py."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import runtime_only_env, ultrascale
from ultrascale.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
OUTSIDE = ".." + "/shared"  # a folder beside the working copy that a clone does not have
LONG = {"calibrate", "sweep", "ui"}  # minutes, or a server: their arguments and files checked


def blocks(kind: str) -> list[list[str]]:
    return [b.splitlines() for b in re.findall(rf"```{kind}\n(.*?)```", README, re.S)]


def bash_commands() -> list[list[str]]:
    return [shlex.split(line, comments=True) for block in blocks("bash") for line in block
            if line.startswith("ultrascale ")]


def console_examples() -> list[tuple[list[str], str]]:
    out = []
    for block in blocks("console"):
        for i, line in enumerate(block):
            if line.startswith("$ ultrascale "):
                shown = []
                for follow in block[i + 1:]:
                    if follow.startswith("$ "):
                        break
                    shown.append(follow)
                out.append((shlex.split(line[2:]), "\n".join(shown)))
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """An empty folder with the repository's configs/ and benchmarks/: commands write there."""
    path = tmp_path_factory.mktemp("readme")
    for name in ("configs", "benchmarks"):
        (path / name).symlink_to(ROOT / name)
    return path


def test_the_runtime_only_environment_hides_exactly_the_test_packages():
    code = ("import importlib.util as u; print([m for m in ('scipy', 'pytest', 'transformers', "
            "'numpy', 'pyarrow', 'tokenizers', 'matplotlib') if u.find_spec(m)])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=runtime_only_env(), timeout=60)
    assert proc.stdout.strip() == "['numpy', 'pyarrow', 'tokenizers', 'matplotlib']", proc.stderr


def test_the_readme_has_commands_to_run():
    subcommands = {argv[1] for argv in bash_commands() if len(argv) > 1}
    assert {"train", "memory", "plan", "config", "tokenize"} <= subcommands
    assert console_examples()


@pytest.mark.parametrize("argv", bash_commands(), ids=lambda a: " ".join(a[1:])[:60])
def test_each_readme_command_runs_as_typed(argv, workdir):
    assert argv[0] == "ultrascale"
    if argv[1] in LONG:
        args = build_parser().parse_args(argv[1:])  # exits on a bad argument
        for value in vars(args).values():
            if isinstance(value, str) and value.endswith((".yaml", ".yml")):
                assert (workdir / value).is_file(), value
        return
    proc = ultrascale(*argv[1:], cwd=workdir, timeout=300, runtime_only=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("argv,shown", console_examples(), ids=lambda a: str(a)[:60])
def test_each_readme_console_example_prints_what_it_shows(argv, shown, workdir):
    proc = ultrascale(*argv[1:], cwd=workdir, timeout=120, runtime_only=True)
    printed = proc.stdout + proc.stderr
    if shown.startswith("error:"):
        assert proc.returncode == 2
    assert shown.strip() in printed, printed


def test_no_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:
        names = tracked.stdout.splitlines()
    else:  # not a git checkout (an unpacked archive): every file but hidden folders' ones
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not any(part.startswith(".") for part in
                                            p.relative_to(ROOT).parts[:-1])]
    offenders = []
    for name in names:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sbatch", "") \
                and path.is_file() and name != "tests/test_readme.py":
            if OUTSIDE in path.read_text(errors="replace"):
                offenders.append(name)
    assert offenders == []


def test_pyproject_cites_files_that_exist():
    text = (ROOT / "pyproject.toml").read_text()
    for cited in re.findall(r"[\w./-]*requirements[\w.-]*\.txt", text):
        assert (ROOT / cited).is_file(), cited


def test_help_texts_cite_configs_that_exist_and_no_internal_notes():
    parser = build_parser()
    helps = {name: sub.format_help() for name, sub in
             parser._subparsers._group_actions[0].choices.items()}
    for name, text in helps.items():
        for cited in re.findall(r"configs/[\w.-]+\.(?:yaml|sbatch)", text):
            assert (ROOT / cited).is_file(), f"`ultrascale {name} --help` cites {cited}"
    assert "before cli.py wires it" not in helps["plan"]
    assert "torch and numpy are imported" not in helps["calibrate"]
    assert "ultrascale config keys" in helps["train"]
