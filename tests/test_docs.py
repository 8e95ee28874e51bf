"""The docs cannot rot: every `python train.py ...`, `python eval.py ...`, `torchrun ...
train.py ...` and `APP=train.py sbatch ... launch/ddp_launcher/sbatch_example.sh ...` command
in README.md and docs/*.md is composed by Hydra in this process (as `python train.py --cfg job
<overrides>` would, without torch or a process), so a renamed key, group or choice fails here,
naming the file and line of the command. Commands that need data or a cluster are composed,
not run; a sweep (`-m`) has each of its jobs composed."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from ddp_launcher.core.hydra_compat import VERSION_BASE

REPO = Path(__file__).resolve().parent.parent  # tests/helpers.py would import torch
IMPORT_PATH = os.pathsep.join([str(REPO), str(REPO / "launch")])  # as tests/helpers.py

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# (the sbatch example runs the app its APP variable names)
SCRIPTS = {"train.py": "train", "eval.py": "eval", "launch/ddp_launcher/sbatch_example.sh": "train"}
# Hydra's own flags: those that take a value, and those that do not (they change what Hydra
# prints, not what it composes).
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "-sc", "--shell-completion"}
FLAGS_WITH_VALUE |= {"--config-name", "-cn", "--experimental-rerun"}
PLAIN_FLAGS = {"--help", "-h", "--hydra-help", "--resolve", "--version"}
MULTIRUN_FLAGS = {"-m", "--multirun"}
CONFIG_DIR_FLAGS = {"--config-dir", "-cd"}
ABSENT = object()
COMMAND_START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(python3? |torchrun |sbatch |srun )")


@dataclass(frozen=True)
class Command:
    where: str  # "docs/x.md:12"
    text: str  # the command as written (continuations joined, comment dropped)
    config: str  # "train" or "eval"
    overrides: tuple[str, ...]
    multirun: bool
    config_dir: str | None


def placeholder_free(token: str) -> str:
    """`<that dir>`, `<0|1>` and the like stand for a value the reader fills in: the first
    of the alternatives, else a word."""
    return re.sub(r"<([^<>|]*\|)?[^<>]*>", lambda m: (m[1] or "X|")[:-1] or "X", token)


def parse(text: str, where: str) -> Command | None:
    """The Hydra command line in a shell command, or None when it runs neither script."""
    try:
        words = shlex.split(placeholder_free(text), comments=True)
    except ValueError as e:
        raise AssertionError(f"{where}: `{text}` is not a shell command: {e}") from e
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    script = next((i for i, w in enumerate(words) if w in SCRIPTS), None)
    if script is None or words[0] not in {"python", "python3", "torchrun", "sbatch", "srun"}:
        return None
    if words[0].startswith("python") and script != 1:
        return None  # `python -m docs.bench`, `python -m launch.summary`: no Hydra config
    overrides, multirun, config_dir = [], False, None
    args = iter(words[script + 1 :])
    for word in args:
        if word in MULTIRUN_FLAGS:
            multirun = True
        elif word in CONFIG_DIR_FLAGS:
            config_dir = next(args)
        elif word in FLAGS_WITH_VALUE:
            next(args, None)
        elif word in PLAIN_FLAGS or word == "--info":
            continue
        elif word == "...":
            continue  # "and the rest of your overrides"
        elif word.startswith("-"):
            raise AssertionError(f"{where}: `{text}`: unknown flag {word}")
        else:
            overrides.append(word)
    config = SCRIPTS[words[script]]
    if words[script].endswith("sbatch_example.sh"):  # it runs the script APP names
        if env.get("APP") not in SCRIPTS:
            raise AssertionError(f"{where}: `{text}` runs the example's placeholder app: set APP")
        config = SCRIPTS[env["APP"]]
    shown = re.sub(r"\s+#[^'\"]*$", "", text)  # the command without its trailing comment
    return Command(where, shown, config, tuple(overrides), multirun, config_dir)


def shell_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """A code block's commands, each with the line it starts on (`\\` continues a line)."""
    commands, current, start = [], "", first_line
    for offset, line in enumerate(block.splitlines()):
        if not current:
            start = first_line + offset
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        commands.append((start, current.strip()))
        current = ""
    return [(n, c) for n, c in commands if COMMAND_START.match(c)]


def collect(path: Path, name: str | None = None) -> list[Command]:
    """Every command in a Markdown file: in fenced code blocks and in inline code."""
    text = path.read_text()
    name = name or path.relative_to(REPO).as_posix()
    found: list[tuple[int, str]] = []
    fences = list(re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S))
    for fence in fences:
        first = text.count("\n", 0, fence.start(1)) + 1
        found += shell_lines(fence.group(1), first)
    outside = text
    for fence in reversed(fences):  # blank the blocks, keeping line numbers
        outside = (
            outside[: fence.start()] + "\n" * fence.group(0).count("\n") + outside[fence.end() :]
        )
    for span in re.finditer(r"`([^`]+)`", outside):
        command = " ".join(span.group(1).split())
        if COMMAND_START.match(command):
            found.append((outside.count("\n", 0, span.start()) + 1, command))
    commands = []
    for line, command in sorted(found):
        parsed = parse(command, f"{name}:{line}")
        if parsed is not None:
            commands.append(parsed)
    return commands


def jobs(command: Command) -> list[list[str]]:
    """The override lists to compose: the command's, or for a sweep (`-m`) enough of its jobs
    that every swept value is in one of them: job i takes each key's i-th value (cycling), so
    a grid of 3 x 2 costs 3 compositions, not 6."""
    if not command.multirun:
        return [list(command.overrides)]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(command.overrides))
    values = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            values.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            values.append([override.input_line])
    return [[v[i % len(v)] for v in values] for i in range(max(map(len, values), default=1))]


def compose(command: Command, configs: list | None = None) -> int:
    """Compose every job of `command` as its script would; returns how many were composed
    (and appends each composed config to `configs`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import conf.schema  # noqa: F401 - registers the schema the YAMLs extend

    search = []
    if command.config_dir:
        search = [f"hydra.searchpath=[file://{(REPO / command.config_dir).resolve()}]"]
    GlobalHydra.instance().clear()
    composed = 0
    try:
        with initialize_config_dir(str(REPO / "conf"), **VERSION_BASE):
            for overrides in jobs(command):
                try:
                    cfg = hydra_compose(
                        command.config, [*search, *overrides], return_hydra_config=True
                    )
                    searched = cfg.hydra.sweeper.get("params") or {}
                    unknown = [
                        k for k in searched if OmegaConf.select(cfg, k, default=ABSENT) is ABSENT
                    ]
                    if unknown:  # an Optuna search space over keys the config no longer has
                        raise KeyError(f"hydra.sweeper.params searches unknown keys {unknown}")
                    if configs is not None:
                        configs.append(cfg)
                except Exception as e:  # noqa: BLE001 - any composition error is the finding
                    message = " ".join(str(e).split())
                    raise AssertionError(
                        f"{command.where}: `{command.text}` does not compose "
                        f"({' '.join(overrides)}): {type(e).__name__}: {message}"
                    ) from None
                composed += 1
    finally:
        GlobalHydra.instance().clear()
    return composed


COMPOSED: set[tuple] = set()  # the same overrides in several places are composed once


def compose_once(command: Command) -> int:
    key = (command.config, command.config_dir, command.overrides, command.multirun)
    if key in COMPOSED:
        return 1
    composed = compose(command)
    COMPOSED.add(key)
    return composed


COMMANDS = [c for path in DOCS for c in collect(path)]


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_composes(command):
    assert compose_once(command) >= 1


def test_the_docs_hold_the_commands_people_run():
    """The README's ten commands and every topic's examples are found (a parser that silently
    finds nothing would pass the test above)."""
    readme = [c for c in COMMANDS if c.where.startswith("README.md:")]
    assert len(readme) >= 10, [c.text for c in readme]
    texts = [c.text for c in COMMANDS]
    assert any(c.multirun and "hydra/launcher=slurm" in c.overrides for c in COMMANDS)
    assert any(c.config == "eval" for c in COMMANDS)
    assert any(t.startswith("torchrun ") for t in texts)
    assert any(c.config_dir for c in COMMANDS)
    assert {c.where.split(":")[0] for c in COMMANDS} >= {
        "README.md",
        "docs/running.md",
        "docs/sweeps.md",
        "docs/slurm.md",
        "docs/fault-tolerance.md",
        "docs/evaluate.md",
        "docs/recipes.md",
        "docs/debugging.md",
        "docs/own-dataset.md",
    }


@pytest.mark.parametrize(
    "doc, broken, why",
    [
        ("python train.py trainer.max_epoch=3", "trainer.max_epoch", "a renamed key"),
        ("python train.py -m optim=sgd,adam", "adam", "a choice that is gone, in a sweep's job"),
        ("torchrun --nproc_per_node=2 train.py modle=resnet18", "modle", "a renamed group"),
        ("python eval.py run=X splitt=val", "splitt", "eval.py's own config"),
    ],
)
def test_a_broken_command_fails_naming_its_file_and_line(tmp_path, doc, broken, why):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\nIntro.\n\n```bash\n# {why}\n{doc} \\\n    seed=1\n```\n")
    (command,) = collect(page, "page.md")
    with pytest.raises(AssertionError) as failure:
        compose(command)
    assert command.where.endswith("page.md:7")
    assert "page.md:7" in str(failure.value) and broken in str(failure.value)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, `-` for spaces)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_link_and_picture_resolves():
    """Links between the pages reach a file and heading that exist; pictures exist and stay
    small (< 200 KB)."""
    broken = []
    for path in DOCS:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(REPO)}: ({target})"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and anchor not in anchors(linked):
                broken.append(f"{where}: no heading #{anchor}")
            elif linked.suffix == ".png" and linked.stat().st_size >= 200_000:
                broken.append(f"{where}: {linked.stat().st_size} bytes, over 200 KB")
    assert not broken, "\n".join(broken)


def test_composing_in_process_is_what_the_script_composes():
    """The in-process composition above stands for `python train.py --cfg job ...`: the same
    job config, `--config-dir` included (checked once against the real entry point)."""
    import subprocess
    import sys

    import yaml
    from omegaconf import OmegaConf, open_dict

    text = "python train.py --config-dir data/example/conf dataset=shapes trainer.max_epochs=2"
    command = parse(text, "here")
    configs: list = []
    compose(command, configs)
    (cfg,) = configs
    with open_dict(cfg):
        del cfg["hydra"]  # what --cfg job prints: the job's config, as YAML
    in_process = yaml.safe_load(OmegaConf.to_yaml(cfg))
    script = [sys.executable, "train.py", "--cfg", "job", *shlex.split(text)[2:]]
    env = {**os.environ, "PYTHONPATH": IMPORT_PATH}  # this checkout's launcher package
    printed = subprocess.run(script, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert yaml.safe_load(printed.stdout) == in_process
    assert in_process["dataset"]["_target_"] == "data.example.shapes.shapes"


def test_the_readme_stays_a_landing_page():
    """The README stays short (topics belong in docs/), keeps its two set-up commands and links
    every page of docs/."""
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move a topic to docs/"
    long = [n for n, line in enumerate(lines, 1) if len(line) > 170]
    assert not long, f"README.md lines over 170 characters: {long}"
    assert "pip install -r requirements.txt && python train.py\n" in readme
    assert "pip install -r requirements.txt && python -m pytest\n" in readme
    unlinked = [p.name for p in DOCS[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"


def readme_test_command() -> str:
    """README command 2, the line under `# 2. ...`, found as .ci/run finds it."""
    lines = (REPO / "README.md").read_text().splitlines()
    return next(lines[n + 1] for n, line in enumerate(lines) if line.startswith("# 2. "))


def test_ci_and_the_workflow_run_the_readmes_test_command():
    """.ci/run runs README command 2 as the README writes it (it reads the line), and the GitHub
    workflow runs the same line: the whole suite on each Python of its matrix, and the line
    with `-m "not slow"` on the newest."""
    import yaml

    command = readme_test_command()
    assert command == "pip install -r requirements.txt && python -m pytest"
    ci = (REPO / ".ci" / "run").read_text()
    assert "grep -A1 '^# 2\\. ' README.md" in ci and 'eval "$readme_tests"' in ci
    jobs = yaml.safe_load((REPO / ".github" / "workflows" / "tests.yml").read_text())["jobs"]
    runs = {name: [step.get("run", "") for step in job["steps"]] for name, job in jobs.items()}
    assert any(f"'{command}'" in run for run in runs["suite"]), runs["suite"]
    assert f'{command} -m "not slow"' in runs["not-slow"], runs["not-slow"]
    pythons = jobs["suite"]["strategy"]["matrix"]["python"]
    newest = max(pythons, key=lambda v: tuple(map(int, v.split("."))))
    assert jobs["not-slow"]["steps"][1]["with"]["python-version"] == newest


def test_requires_python_is_what_the_workflow_tests():
    """pyproject.toml's requires-python allows exactly the Pythons the workflow's suite runs
    on, each tested here (docs/architecture.md#python-versions)."""
    import yaml

    # (tomllib is 3.11's: the suite runs on 3.10 too)
    spec = re.search(r'^requires-python = "(.*)"$', (REPO / "pyproject.toml").read_text(), re.M)
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", spec[1]).groups()
    jobs = yaml.safe_load((REPO / ".github" / "workflows" / "tests.yml").read_text())["jobs"]
    tested = jobs["suite"]["strategy"]["matrix"]["python"]
    assert tested == [f"3.{minor}" for minor in range(int(low), int(high))]


def named_files(path: Path) -> list[tuple[int, str]]:
    """The repository files a page names: `folder/file.py` anywhere, and a bare `file.py` in a
    table row or under a heading that names its folder (`| \\`launch/\\` | ... \\`slurm.py\\``,
    `### \\`components/\\`: ...`). Run-dir files (result.json, ...) are not the repo's."""
    text = re.sub(
        r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), path.read_text(), flags=re.M | re.S
    )
    folder_in = re.compile(r"`([\w-]+(?:/[\w-]+)*)/`")
    heading_folder, named = None, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            found = folder_in.search(line)
            heading_folder = found[1] if found else None
            continue
        row = folder_in.match(line[2:]) if line.startswith("| `") else None
        folder = row[1] if row else heading_folder
        for name in re.findall(r"`([\w./-]+\.(?:py|sh|yaml))`", line):
            if "/" in name or (REPO / name).exists():  # a path, or train.py / eval.py
                named.append((number, name))
            elif folder:
                named.append((number, f"{folder}/{name}"))
    return named


def importable(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is gone too
        return False


def test_every_named_file_and_module_exists():
    """A file or module the pages name exists: a moved module fails here, naming the page and
    line to update (the code maps in README.md and docs/architecture.md name most of them)."""
    missing = []
    for path in DOCS:
        where = path.relative_to(REPO).as_posix()
        missing += [
            f"{where}:{n}: {name}" for n, name in named_files(path) if not (REPO / name).exists()
        ]
    modules = set()
    for path in DOCS:
        for module in re.findall(r"python3? -m ([a-z_][\w.]*)", path.read_text()):
            if module.split(".")[0] in {p.name for p in REPO.iterdir() if p.is_dir()}:
                modules.add((path.relative_to(REPO).as_posix(), module))
    missing += [f"{where}: python -m {m}" for where, m in sorted(modules) if not importable(m)]
    assert len(named_files(REPO / "docs" / "architecture.md")) > 30  # the lists are read
    assert not missing, "\n".join(missing)
