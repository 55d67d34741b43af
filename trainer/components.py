"""Every component's config group: importing this module imports the dataset, loader and model
packages, whose files register their options (`loader=prefetch`) with Hydra's ConfigStore. Import
it before composing a config (`python -m trainer` does, through `trainer.loop.run`).

It also gives `python -m trainer --help` its list of options (`${feedbench_options:}` in
conf/config.yaml's help template), read from the registries and the presets themselves."""

import re

from omegaconf import OmegaConf

from datasets import DATASETS
from models import MODELS
from trainer.config import CONF_DIR
from trainer.loaders import LOADERS

REGISTRIES = {"dataset": DATASETS, "loader": LOADERS, "model": MODELS}  # config group -> its registry
GROUP_TITLES = {"loader": "how batches reach the device", "dataset": "what is fed", "model": "what trains on it"}


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line: it ends at a `.`, `?` or
    `!` before a space, outside parentheses (`(e.g. ...)` does not end it)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    depth = 0
    for i, char in enumerate(paragraph):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char in ".?!" and depth <= 0 and paragraph[i + 1:i + 2] == " ":
            return paragraph[:i + 1]
    return paragraph


def preset_line(path) -> str:
    """A preset's summary: the first sentence of the first comment paragraph of its YAML file (after
    `# @package`; a blank or indented comment line, a command, ends it), read whole when the sentence
    goes on to the next line: never cut mid-parenthesis."""
    paragraph = []
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            continue
        if line.startswith("#") and line[1:].strip() and not line.startswith("#   "):
            paragraph.append(line[1:].strip())
        elif paragraph:
            break
    return first_sentence(" ".join(paragraph))


def options_help() -> str:
    """Every option a user picks, one line each, from its Config docstring or its preset's first comment."""
    # conf/experiment's subfolders (`+experiment/copy_mode=...`) are a preset's own cases: not listed.
    presets = sorted((CONF_DIR / "experiment").glob("*.yaml"))
    width = max(len(name) for name in [*(n for r in REGISTRIES.values() for n in r), *(p.stem for p in presets)])
    lines = []
    for group, registry in REGISTRIES.items():
        lines.append(f"{group}=NAME   {GROUP_TITLES[group]}")
        lines += [f"  {name:<{width}}  {first_sentence(cls.Config.__doc__)}" for name, cls in sorted(registry.items())]
        lines.append("")
    lines.append("experiment=NAME   a preset: a sweep of its own (python -m trainer -m experiment=NAME)")
    lines += [f"  {p.stem:<{width}}  {preset_line(p)}" for p in presets]
    return "\n".join(lines)


if not OmegaConf.has_resolver("feedbench_options"):
    OmegaConf.register_new_resolver("feedbench_options", options_help)
