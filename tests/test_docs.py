"""The README and docs/ as a user reads them: every fenced command is run or checked, so none drifts.

Cheap commands run on the CPU, with tiny sizes appended where the command is long (the first run,
the README's sweep and its table, `trainer.report`, `--help`, the own-loop snippet, the offline
data). The others are checked as far as they go without a GPU, a cluster or minutes of time: a
`python -m trainer` command (or torchrun's) composes and validates with every value it sweeps; a
tool's arguments parse with the tool's own parser and its Hydra overrides compose; a script exists
and parses; what CI or another test runs is named. A command of none of these kinds fails the test.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Tuple
from unittest import mock

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from trainer.__main__ import args_parser, hydra_argv
from trainer.components import REGISTRIES, first_sentence, preset_line
from trainer.config import CONF_DIR, PROJECT_ROOT
from trainer.validate import validate

from clirun import TINY, all_runs, command
from conftest import compose_config

PAGES = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# Run elsewhere: CI runs the README's test command (.ci/run); the tests named run the rest.
ELSEWHERE = {
    "python -m pip install": ".ci/run",
    "python -m pytest": ".ci/run",
    "python -m pip wheel": "tests/test_install.py::test_wheel_installed_in_a_fresh_environment_runs_from_elsewhere",
}


class Block(NamedTuple):
    page: Path
    lang: str
    text: str
    heading: str


def blocks(page: Path) -> Iterator[Block]:
    """The fenced blocks of a page, with the heading they stand under."""
    heading = ""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("```"):
            lang, body = line[3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            yield Block(page, lang, "\n".join(body) + "\n", heading)
        i += 1


def commands(block: Block) -> List[List[str]]:
    """The commands of a bash block: lines joined at `\\`, `NAME="..."` assignments expanded,
    comments dropped, split at `&&`."""
    text = block.text.replace("\\\n", " ")
    env = {"PWD": str(PROJECT_ROOT)}
    found = []
    for line in text.splitlines():
        assignment = re.fullmatch(r'([A-Z_]+)="([^"]*)"', line.strip())
        if assignment:
            env[assignment.group(1)] = assignment.group(2)
            continue
        line = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), line)
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(words[:cut])
            words = words[cut + 1:]
    return found


def all_commands() -> List[Tuple[Block, List[str]]]:
    return [(b, c) for page in PAGES for b in blocks(page) if b.lang == "bash" for c in commands(b)]


def cmd_id(item) -> str:
    block, cmd = item
    return f"{block.page.name}: {' '.join(cmd)[:90]}"


# ----------------------------------------------------------------------------- checking without running
def compose_every_value(overrides: List[str]) -> int:
    """Compose and validate the config with each value of each swept key (the others at their
    first value); return how many configs were checked."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    first, sweeps = [], []
    for text, o in zip(overrides, parsed):
        if o.is_sweep_override():
            values = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            first.append(values[0])
            sweeps.append((len(first) - 1, values))
        else:
            first.append(text)
    variants = [first] + [first[:i] + [v] + first[i + 1:] for i, values in sweeps for v in values[1:]]
    for variant in variants:
        validate(compose_config(*variant))
    return len(variants)


def trainer_overrides(args: List[str]) -> List[str]:
    """The Hydra overrides among `python -m trainer`'s arguments, parsed as the command line parses
    them (a bad option fails the test)."""
    return args_parser().parse_args(hydra_argv(args)).overrides


class Parsed(Exception):
    """Raised in place of running a tool once its arguments are parsed."""


def parse_only(main, prog: str, argv: List[str]) -> argparse.Namespace:
    """The namespace the tool's own `main` parses from `argv`, without running the tool."""
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse), \
            mock.patch.object(argparse.ArgumentParser, "parse_intermixed_args", parse), \
            mock.patch.object(sys, "argv", [prog, *argv]):
        try:
            main(argv) if inspect.signature(main).parameters else main()
        except Parsed as done:
            return done.args[0]
    raise AssertionError(f"{prog} never parsed its arguments")


def tool_module(words: List[str]):
    """(module, prog, argv) of `python -m pkg.mod ...` or `python path/to/script.py ...`."""
    if words[1] == "-m":
        return importlib.import_module(words[2]), words[2], words[3:]
    path = PROJECT_ROOT / words[1]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, words[1], words[2:]


def check_tool(words: List[str]) -> None:
    """The tool parses its arguments; the configs it would compose from them compose: its overrides
    (after a script's own `COMMON` ones), with each of `--loaders`, `--graph` and each side `--a`/`--b`."""
    module, prog, argv = tool_module(words)
    args = parse_only(module.main, prog, argv)
    base = [*getattr(module, "COMMON", []), *(getattr(args, "overrides", None) or [])]
    graphs = {"eager": ["false"], "graphed": ["true"], "both": ["false", "true"]}.get(getattr(args, "graph", None), [None])
    loaders = [s for s in (getattr(args, "loaders", None) or "").split(",") if s] or [None]
    sides = [side for side in (getattr(args, "a", None), getattr(args, "b", None)) if side] or [[]]
    if not base and loaders == [None] and sides == [[]]:
        return  # a tool without Hydra overrides: parsing them was the check
    for side in sides:
        for loader in loaders:
            for graph in graphs:
                compose_every_value([*base, *([f"loader={loader}"] if loader else []),
                                     *([f"engine.cuda_graph={graph}"] if graph else []), *side])


def check_script(words: List[str]) -> None:
    script = PROJECT_ROOT / words[1]
    assert script.is_file(), script
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for name in re.findall(r"(?<![\w.])experiment=\"?(\w+)", script.read_text()):  # not tracking.experiment=
        assert name in PRESETS or name == "preset", (script, name)


def check_torchrun(words: List[str]) -> None:
    from torch.distributed.run import get_args_parser
    args = get_args_parser().parse_args(words[1:])
    assert (args.module, args.training_script) == (True, "trainer")
    compose_every_value(trainer_overrides(args.training_script_args))


def check_mlflow(words: List[str]) -> None:
    from mlflow.cli import cli
    sub = cli.get_command(None, words[1])
    sub.make_context(words[1], words[2:])  # click parses the options; an unknown one raises


def check(words: List[str]) -> str:
    """Check one command without running it; return how."""
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)] if re.fullmatch(r"[A-Z_]+=.*", words[0]) else words
    line = " ".join(words)
    for prefix, where in ELSEWHERE.items():
        if line.startswith(prefix):
            return where
    if words[:3] == ["python", "-m", "trainer"]:
        compose_every_value(trainer_overrides(words[3:]))
        return "composed"
    if words[0] == "torchrun":
        check_torchrun(words)
        return "composed"
    if words[0] == "python":
        check_tool(words)
        return "parsed"
    if words[0] == "bash":
        check_script(words)
        return "script"
    if words[0] == "mlflow":
        check_mlflow(words)
        return "parsed"
    raise AssertionError(f"no check for this kind of command: {line}")


@pytest.mark.parametrize("item", all_commands(), ids=cmd_id)
def test_every_documented_command_is_checked(item):
    block, words = item
    how = check(words)
    if "::" in how:  # the test that runs it exists
        path, name = how.split("::")
        assert f"def {name}(" in (PROJECT_ROOT / path).read_text(), how


def test_the_readme_test_command_is_the_second_bash_block_ci_runs():
    bash = [b for b in blocks(PROJECT_ROOT / "README.md") if b.lang == "bash"]
    assert bash[1].text.strip() == "python -m pip install -e '.[test,lightning]' && python -m pytest"
    ci = (PROJECT_ROOT / ".ci" / "run").read_text()
    assert "awk '/^```bash$/{n++; next} /^```$/{next} n==2 && !done {print; done=1}' README.md" in ci
    assert "chromium" in bash[1].page.read_text().split("```bash", 3)[2]  # the README says the UI test needs it


def test_the_readme_says_how_long_the_tests_take():
    after = (PROJECT_ROOT / "README.md").read_text().split("python -m pip install -e '.[test,lightning]' && python -m pytest")[1]
    assert re.search(r"take about \d+\s+minutes on a 2-core CPU machine", after.split("\n\n")[1])  # the paragraph after it


def test_every_mlflow_ui_command_listens_on_localhost_only():
    """The UI can change and delete runs: every `mlflow ui` a page shows, in a block or inline, keeps it local."""
    for page in PAGES:
        for ui in re.findall(r"mlflow ui [^`\n]*", page.read_text()):
            assert "--host 127.0.0.1" in ui, (page.name, ui)


def test_the_readme_fits_and_every_link_and_anchor_resolves():
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), (page.name, target)
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file), (page.name, target, sorted(anchors(file)))


def anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_named_preset_and_strategy_exists():
    """A preset or strategy named anywhere a user reads (prose included) is one that exists."""
    strategies = set(REGISTRIES["loader"])
    scripts = [p for p in (PROJECT_ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    texts = [*PAGES, *scripts, *(CONF_DIR / "experiment").rglob("*.yaml")]
    for path in texts:
        text = path.read_text()
        # `experiment=NAME` as a user types it (not `tracking.experiment=`, nor a Python keyword argument)
        for name in re.findall(r"(?<![.\w])experiment=(\w+)(?![\w,)])", text):
            assert name in PRESETS or name == "NAME", (path.name, name)
        for name in re.findall(r"(?<![.\w])loader=(\w+)(?![\w,)])", text):
            assert name in strategies or name == "NAME", (path.name, name)
        assert not re.search(r"seed ?0\d\d|seed_iterable|bench_seed0", text, re.I), path.name


# ----------------------------------------------------------------------------- running the cheap ones
def readme_block(heading: str, lang: str, index: int = 0) -> str:
    found = [b.text for b in blocks(PROJECT_ROOT / "README.md") if b.heading == heading and b.lang == lang]
    return found[index]


def table_rows(text: str) -> List[List[str]]:
    """A printed comparison: its header, then each job's cells (split at runs of two spaces or more)."""
    lines = [line for line in text.splitlines() if line.startswith("job ") or re.match(r"\d+ ", line)]
    return [re.split(r"\s{2,}", line.strip()) for line in lines]


@pytest.fixture(scope="module")
def readme_sweep(tmp_path_factory, empty_store):
    """The README's sweep, at a tiny length, in a store of its own: (tracking uri, the process)."""
    tmp = tmp_path_factory.mktemp("sweep")
    db = tmp / "mlflow.db"
    db.write_bytes(empty_store.read_bytes())
    uri = f"sqlite:///{db}"
    (words,) = commands(Block(Path("README.md"), "bash", readme_block("Compare strategies in a minute", "bash"), ""))
    assert words[:4] == ["python", "-m", "trainer", "-m"]
    tiny = ["engine.max_steps=8", "engine.warmup_steps=2", "dataset.num_samples=96", "engine.device=cpu", "engine.progress=false"]
    proc = subprocess.run(command(tmp, uri, *words[3:], *tiny), cwd=tmp, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return uri, proc, tmp


def test_the_readme_sweep_prints_the_table_the_readme_shows(readme_sweep):
    """Same columns, same jobs in the same order; only the figures differ from run to run."""
    _, proc, _ = readme_sweep
    shown = table_rows(readme_block("Compare strategies in a minute", ""))
    printed = table_rows(proc.stdout)
    assert printed[0] == shown[0]  # the header
    assert [row[:3] for row in printed[1:]] == [row[:3] for row in shown[1:]]  # job, loader, status
    # On the CPU both GPU strategies ran their CPU path: no job is crowned best over the baseline.
    assert proc.stdout.splitlines()[-1] == ("best: none: jobs 1, 2 are degraded (no CUDA: the CPU path ran, not the "
                                            "strategy named), so job 0 alone measured what it names: nothing to rank")


def test_the_report_command_prints_the_latest_sweep_again(readme_sweep):
    uri, proc, tmp = readme_sweep
    (words,) = [c for b, c in all_commands() if c[:3] == ["python", "-m", "trainer.report"] and len(c) == 3][:1]
    again = subprocess.run([sys.executable, *words[1:], "--uri", uri], cwd=tmp, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert table_rows(again.stdout) == table_rows(proc.stdout)


def test_the_first_run_records_a_finished_run(tmp_path, tracking_uri):
    """`python -m trainer`, the README's first command, at a tiny size."""
    first = commands(Block(Path("README.md"), "bash", readme_block("Install and first run", "bash"), ""))
    assert first[-1] == ["python", "-m", "trainer"]
    proc = subprocess.run(command(tmp_path, tracking_uri, *TINY), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = all_runs(tracking_uri)
    assert run.info.status == "FINISHED" and run.data.params["loader.name"] == "baseline"


def test_help_lists_every_option_with_its_line_and_hides_the_internal_groups(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer", "loader=prefetch", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "This run would use: dataset=synthetic loader=prefetch model=autoencoder" in out
    for group, registry in REGISTRIES.items():
        for name, cls in registry.items():
            line = first_sentence(cls.Config.__doc__)
            assert not line.startswith("Config("), f"{group}={name} has no docstring of its own"  # dataclass's default
            assert re.search(rf"^  {name} +{re.escape(line)}$", out, re.M), (group, name)
    for preset in PRESETS:
        assert re.search(rf"^  {preset} +{re.escape(preset_line(CONF_DIR / 'experiment' / f'{preset}.yaml'))}$", out, re.M)
    for internal in ("copy_mode", "pin_memory_cifar_setting", "config_schema", "schema/", "hydra/"):
        assert internal not in out


def test_a_preset_line_is_its_first_sentence_whole_never_cut_mid_parenthesis(tmp_path):
    tune = preset_line(CONF_DIR / "experiment" / "tune_dataloader.yaml")
    assert tune == ("The tuner: Hydra's Optuna sweeper picks the strategy and its knobs (DataLoader workers, "
                    "prefetch_factor, persistent workers; non_blocking; depth; threads) that maximise engine.objective "
                    "(throughput_samples_per_s by default), one job at a time.")
    preset = tmp_path / "p.yaml"
    preset.write_text("# @package _global_\n# Does it copy (e.g. on a side\n# stream)? It does.\n#   python -m trainer\n")
    assert preset_line(preset) == "Does it copy (e.g. on a side stream)?"
    preset.write_text("# @package _global_\n# One line, no stop\n#\n# Another paragraph.\nloader: x\n")
    assert preset_line(preset) == "One line, no stop"
    assert first_sentence("A (b. c) d. E.") == "A (b. c) d."


def test_the_own_loop_snippet_runs_as_written_and_says_what_it_did(capsys):
    """The README's snippet, exactly as printed (docs/own_loop.md shows the same text), on this machine's
    device: the CPU here, the GPU where there is one. It prints a line per epoch."""
    snippet = readme_block("A strategy in your own loop", "python")
    assert snippet in (PROJECT_ROOT / "docs" / "own_loop.md").read_text()
    namespace: Dict[str, object] = {"__name__": "readme"}
    exec(compile(snippet, "README.md", "exec"), namespace)
    import torch
    assert namespace["device"].type == ("cuda" if torch.cuda.is_available() else "cpu")
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert re.fullmatch(rf"epoch 0: 8 batches of \[64, 256, 256\] on {device}, last loss \d+\.\d{{3}}\n"
                        rf"epoch 1: 8 batches of \[64, 256, 256\] on {device}, last loss \d+\.\d{{3}}\n",
                        capsys.readouterr().out)
    assert torch.isfinite(namespace["loss"]) and namespace["loader"].cfg.name == "prefetch"
    assert namespace["cfg"].loader.depth == 1  # the typed section of the chosen strategy


def test_the_offline_data_command_prints_how_to_use_what_it_wrote(tmp_path, capsys, monkeypatch):
    """The README's `python -m trainer.fake_data`, run where the README runs it (its default folder
    is relative), then the preset command it leads to composes with that folder."""
    from trainer import fake_data
    (line,) = [c for b, c in all_commands() if c[:3] == ["python", "-m", "trainer.fake_data"]][:1]
    monkeypatch.chdir(tmp_path)
    assert fake_data.main(line[3:]) == 0
    out = capsys.readouterr().out
    root = Path("data") / "random_pixels"
    assert f"dataset.root={root} dataset.download=false" in out and (tmp_path / root / "README.txt").is_file()
    assert (tmp_path / root / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    assert (tmp_path / root / "cifar-10-batches-py" / "data_batch_5").is_file()


def test_feedbench_config_is_the_cli_config_typed_and_checked():
    from trainer import feedbench_config
    from trainer.errors import ConfigError
    cfg = feedbench_config(["loader=prefetch", "loader.depth=2"])
    assert (cfg.loader.name, cfg.loader.depth, type(cfg.loader).__name__) == ("prefetch", 2, "PrefetchLoader.Config")
    assert feedbench_config("loader=pinned").loader.name == "pinned"  # one override as a string
    with pytest.raises(ConfigError, match=r"^loader\.batch_size must be >= 1 \(got 0\)"):
        feedbench_config(["loader.batch_size=0"])


def test_runs_view_link_opens_the_model_training_view():
    readme = (PROJECT_ROOT / "README.md").read_text()
    links = re.findall(r"http://127\.0\.0\.1:5000/\S*", readme)
    assert links and all("workflowType=machine_learning" in link for link in links)
    assert any("/#/experiments/" in link for link in links)
