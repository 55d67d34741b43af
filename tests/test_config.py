"""Each component owns its config: one registry per group feeds Hydra's ConfigStore and the
builders; each Config checks its own values; the modules import one way, with no cycle."""

from __future__ import annotations

import ast
import dataclasses
import textwrap

import pytest
import torch
from hydra.core.config_store import ConfigStore

from conftest import TINY, compose_config
from datasets import build_dataset
from models import build_model
from trainer.components import REGISTRIES
from trainer.config import PROJECT_ROOT
from trainer.errors import ConfigError
from trainer.loaders import LOADERS, build_loader
from trainer.loaders.prefetch import PrefetchLoader
from trainer.validate import validate

OPTIONS = [(group, name) for group, registry in REGISTRIES.items() for name in registry]


@pytest.mark.parametrize("group,name", OPTIONS)
def test_every_option_composes_and_validates_into_its_own_config(group, name):
    job = validate(compose_config(f"{group}={name}"))
    section = getattr(job, group)
    assert type(section) is REGISTRIES[group][name].Config and section.name == name
    # no YAML file repeats the defaults: the option composes from its Config alone
    assert not (PROJECT_ROOT / "conf" / group / f"{name}.yaml").exists()


def test_the_registries_and_hydras_config_store_agree():
    repo = ConfigStore.instance().repo
    for group, registry in REGISTRIES.items():
        assert sorted(repo[group]) == sorted(f"{name}.yaml" for name in registry)
        for name, cls in registry.items():
            assert repo[group][f"{name}.yaml"].node._metadata.object_type is cls.Config


def test_the_parts_are_built_from_their_typed_configs():
    job = validate(compose_config(*TINY, "loader=prefetch", "loader.depth=2", "model=mlp", "model.hidden=7"))
    dataset = build_dataset(job.dataset)
    with build_loader(job.loader, dataset, torch.device("cpu")) as loader:
        assert isinstance(loader, PrefetchLoader) and loader.cfg is job.loader  # read per batch: a dataclass, not a DictConfig
        assert (loader.cfg.depth, loader.cfg.batch_size) == (2, 16)
    assert dataset.cfg is job.dataset and len(dataset) == 96
    assert build_model(job.model, dataset.sample_shape, dataset.num_classes).net[1].out_features == 7


def test_a_section_of_a_composed_config_builds_the_same_typed_config():
    cfg = compose_config(*TINY, "loader=pinned_gather", "loader.threads=2")
    assert LOADERS.config(cfg.loader) == LOADERS["pinned_gather"].Config(batch_size=16, threads=2)


@pytest.mark.parametrize("overrides,message", [
    (["loader=prefetch", "loader.depth=0"], "loader.depth must be >= 1 (got 0): set loader.depth=1"),
    (["loader=pinned_chunk", "loader.depth=-1"], "loader.depth must be >= 1 (got -1): set loader.depth=1"),
    (["loader=pinned_gather", "loader.threads=0"], "loader.threads must be >= 1 (got 0): set loader.threads=4"),
    (["loader=iterable_chunks", "loader.variant=pin_all"], "loader.variant must be one of no_pinning, copy_in_loader, "
                                                         "pin_batches, pin_chunk (got 'pin_all'): set loader.variant=pin_batches"),
    (["loader.prefetch_factor=0"], "loader.prefetch_factor must be >= 1 (got 0): set loader.prefetch_factor=2"),
    (["model.bottleneck=0"], "model.bottleneck must be >= 1 (got 0): set model.bottleneck=3"),
    (["model=mlp", "model.hidden=0"], "model.hidden must be >= 1 (got 0): set model.hidden=512"),
    (["dataset.num_samples=10", "dataset.chunks=6"], "dataset.num_samples=10 does not split into dataset.chunks=6 chunks "
                                                    "(chunks of 2 make 5): set dataset.chunks=5"),
    (["dataset=cifar10", "dataset.num_samples=-1"], "dataset.num_samples must be >= 0 (got -1): set dataset.num_samples=0 (the whole split)"),
    (["engine.optimizer.lr=0"], "engine.optimizer.lr must be a finite number > 0 (got 0.0): set engine.optimizer.lr=0.001"),
])
def test_a_bad_value_of_a_components_own_key_is_one_line_from_its_config(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*overrides))
    assert str(error.value) == message


def test_each_config_checks_itself_when_made_directly():
    with pytest.raises(ConfigError, match=r"^loader\.depth must be >= 1 \(got 0\): set loader\.depth=1$"):
        PrefetchLoader.Config(depth=0)
    assert PrefetchLoader.Config().depth == 1 and dataclasses.is_dataclass(PrefetchLoader.Config)


def test_a_key_added_with_plus_that_the_section_lacks_is_refused_naming_the_nearest_key():
    cfg = compose_config("loader=prefetch", "+loader.batchsize=1")  # Hydra lets `+` add a key to a schema
    with pytest.raises(ConfigError, match=r"^loader\.batchsize is not a key of loader \(PrefetchLoader\.Config\): "
                                          r"did you mean loader\.batch_size\? set loader\.batch_size=1 instead of "
                                          r"\+loader\.batchsize=1; its keys are name, batch_size, .*depth$"):
        validate(cfg)
    cfg = compose_config("+engine.optimizer.nmae=sgd")  # nested sections too, and booleans as Hydra spells them
    with pytest.raises(ConfigError, match=r"^engine\.optimizer\.nmae is not a key of engine\.optimizer .*: did you mean "
                                          r"engine\.optimizer\.name\? set engine\.optimizer\.name=sgd instead of "):
        validate(cfg)
    cfg = compose_config("+engine.verifyy=true")
    with pytest.raises(ConfigError, match=r"set engine\.verify=true instead of \+engine\.verifyy=true;"):
        validate(cfg)
    cfg = compose_config("+loader.colour=red")  # nothing close: the fix is to remove it
    with pytest.raises(ConfigError, match=r"^loader\.colour is not a key of loader \(BaselineLoader\.Config\): "
                                          r"remove \+loader\.colour; its keys are "):
        validate(cfg)


def test_a_new_option_is_one_file_that_registers_itself(tmp_path, monkeypatch):
    # A package laid out as trainer/loaders/ is: a registry in base.py, discovery in __init__.py.
    package = tmp_path / "extra_loaders"
    package.mkdir()
    (package / "base.py").write_text("from trainer.config import Registry\nREGISTRY = Registry('extra_loader')\n")
    (package / "__init__.py").write_text("from trainer.config import import_modules\nimport_modules(__name__, __path__)\n")
    (package / "twice.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        from extra_loaders.base import REGISTRY
        from trainer.loaders.base import LoaderConfig


        @REGISTRY.register
        class TwiceLoader:
            @dataclass
            class Config(LoaderConfig):
                name: str = "twice"
                times: int = 2

            def __init__(self, cfg):
                self.cfg = cfg
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    from extra_loaders.base import REGISTRY

    assert list(REGISTRY) == ["twice"]  # the new file alone made it an option
    assert REGISTRY.build(REGISTRY["twice"].Config(times=3)).cfg.times == 3
    assert ConfigStore.instance().repo["extra_loader"]["twice.yaml"].node.times == 2


def import_graph(packages) -> dict:
    """`module -> the project modules it imports`, from the import statements of every file,
    those inside functions included (a late import that dodges a cycle is still one)."""
    files = {".".join(p.relative_to(PROJECT_ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for package in packages for p in (PROJECT_ROOT / package).rglob("*.py")}

    def known(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {known(f"{node.module}.{a.name}") for a in node.names}
        # A top-level package importing its own modules (`trainer.__getattr__`) is no cycle of design.
        graph[module] = {d for d in deps - {"", module} if not (module in packages and d.startswith(module + "."))}
    return graph


def reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_no_import_cycle_and_config_imports_no_component():
    graph = import_graph(["trainer", "datasets", "models"])
    cycles = sorted(m for m in graph if m in reachable(graph, m))
    assert cycles == []
    assert not {m for m in reachable(graph, "trainer.config")
                if m.startswith(("datasets", "models", "trainer.loaders", "trainer.loop", "trainer.tracking"))}


# The layers, top to bottom: a module imports only from its own layer or those below it.
LAYERS = (
    ("tools", ("trainer", "trainer.tools", "trainer.__main__", "trainer.advise", "trainer.report", "trainer.versus",
               "trainer.overhead", "trainer.fake_data")),
    ("loop and records", ("trainer.loop", "trainer.tracking")),
    ("strategies", ("trainer.loaders", "trainer.lightning", "trainer.components")),
    ("datasets and models", ("datasets", "models", "trainer.memory")),
    ("config", ("trainer.config", "trainer.errors", "trainer.launch", "trainer.validate")),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that owns `module` (the longest prefix wins)."""
    owners = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
              if module == prefix or module.startswith(prefix + ".")]
    assert owners, f"{module} belongs to no layer: add it to LAYERS"
    return max(owners)[1]


def test_imports_point_down_the_layers_and_the_loop_imports_no_tool():
    graph = import_graph(["trainer", "datasets", "models"])
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
                    for m, deps in graph.items() for d in deps if layer_of(d) < layer_of(m))
    assert upward == []
    into_tools = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                        if m.startswith(("trainer.loop", "trainer.tracking")) and d.startswith("trainer.tools"))
    assert into_tools == []
