"""Your own data and model: `dataset=custom` / `model=custom` through Hydra's `_target_` (a user module
in a folder outside the project, on PYTHONPATH), `model=torchvision`, `dataset=image_folder`,
`engine.precision`, and each bad input as one line naming the key and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F

from clirun import all_runs, run_cli, steps_csv
from conftest import compose_config
from datasets import DATASETS, build_dataset
from models import build_model
from trainer import memory
from trainer.config import PROJECT_ROOT
from trainer.errors import ConfigError, RunFailed
from trainer.loaders import build_loader, for_any_dataset
from trainer.loop.run import run
from trainer.loop.steps import EagerStep, GraphedStep, make_step
from trainer.loop.verify import Checksum
from trainer.tools import plain_loop
from trainer.validate import validate

gpu = pytest.mark.gpu  # skipped without CUDA (conftest)

MODULE = "feedbench_user_code"  # the user's module: a name nothing else uses
USER_CODE = '''
import numpy as np
import torch
from torch import nn


class Points(torch.utils.data.Dataset):
    """n samples of side x side float32 (numpy); y a Python int, or none; one sample larger at ragged_at."""

    def __init__(self, n=44, side=4, classes=3, ragged_at=-1, labels=True, broken_at=-1):
        self.n, self.side, self.classes, self.ragged_at, self.labels = n, side, classes, ragged_at, labels
        self.broken_at = broken_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.broken_at:
            raise RuntimeError("disk on fire")
        side = self.side + (i == self.ragged_at)
        x = np.random.default_rng(i).random((side, side), dtype=np.float32)
        return (x, int(x.sum() * 7) % self.classes) if self.labels else x


def points(**kwargs):
    return Points(**kwargs)


def tensors(n=44):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def float_labels(n=44):
    return torch.rand(n, 4), torch.rand(n)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.zeros(4), 0


def not_a_dataset():
    return 42


NOT_CALLABLE = 3


class Net(nn.Module):
    def __init__(self, side=4, classes=3, hidden=16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(side * side, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class AutoEncoder(nn.Module):
    def __init__(self, side=4):
        super().__init__()
        self.lin = nn.Linear(side * side, side * side)

    def forward(self, x):
        return self.lin(x.flatten(1)).view_as(x)


class OwnLoss(Net):
    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y) + 1.0


def l1(out, y):
    return (out - nn.functional.one_hot(y, out.shape[1]).float()).abs().mean()


def not_a_module():
    return "a model"
'''


@pytest.fixture(scope="session")
def user_folder(tmp_path_factory) -> Path:
    """A folder outside the project holding the user's module."""
    folder = tmp_path_factory.mktemp("user_code")
    assert not folder.resolve().is_relative_to(PROJECT_ROOT)
    (folder / f"{MODULE}.py").write_text(USER_CODE)
    return folder


@pytest.fixture(autouse=True)
def on_pythonpath(user_folder, monkeypatch):
    """The user's folder on the path, as PYTHONPATH puts it there (subprocesses get PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(user_folder))
    monkeypatch.setenv("PYTHONPATH", f"{user_folder}:{PROJECT_ROOT}")


QUICK = ["engine.device=cpu", "engine.progress=false", "engine.warmup_steps=1", "loader.batch_size=8"]
POINTS = ["dataset=custom", f"dataset._target_={MODULE}.points"]
STRATEGIES = [s for s in for_any_dataset() if s != "iterable_chunks"]  # iterable_chunks draws random rows (with replacement)
ONE_BLOCK = ["pinned_chunk", "pinned_gather", "pinned_uva", "gpu_resident"]


def job(*overrides: str):
    return validate(compose_config(*QUICK, *overrides))


def checksums(strategy: str, *overrides: str):
    """`engine.verify`'s checksums of 2 epochs of `strategy` (ordered, per epoch), seeded as a run seeds it."""
    j = job(f"loader={strategy}", *overrides)
    checksum = Checksum(torch.device("cpu"))
    with build_loader(j.loader, build_dataset(j.dataset), torch.device("cpu"), seed=j.engine.seed) as loader:
        for _ in range(2):
            for x, y in loader:
                checksum.update(x, y)
            checksum.end_epoch()
    result = checksum.result()
    return result["data_checksum"], tuple(result["epoch_checksums"]), result["verified_batches"]


def write_images(root: Path, sizes=((20, 30), (31, 17), (16, 16), (40, 25), (9, 12), (22, 22))) -> list:
    """Images of several sizes in two class folders, PNG and JPEG, one of them greyscale; their paths in
    ImageFolder's order."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(sizes):
        folder = root / ("cats" if i % 2 else "dogs")
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (h, w) if i == 4 else (h, w, 3), dtype=np.uint8)
        path = folder / f"{i}.{'png' if i % 3 else 'jpg'}"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return sorted(paths, key=lambda p: (p.parent.name, p.name))


# -- your dataset ------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["points", "tensors"])
@pytest.mark.parametrize("shuffle", ["false", "true"])
def test_custom_data_gives_baselines_batches_through_every_strategy(target, shuffle):
    """44 samples in batches of 8 (a short last one), 2 epochs: unshuffled, every strategy yields
    baseline's bytes in baseline's order; shuffled, the same samples every epoch, and all but
    pinned_chunk (which shuffles whole slices) in baseline's order."""
    found = {s: checksums(s, "dataset=custom", f"dataset._target_={MODULE}.{target}", f"loader.shuffle={shuffle}")
             for s in STRATEGIES}
    assert found["baseline"][2] == 12
    assert len({epochs for _, epochs, _ in found.values()}) == 1, found
    in_order = STRATEGIES if shuffle == "false" else [s for s in STRATEGIES if s != "pinned_chunk"]
    assert len({found[s][0] for s in in_order}) == 1, found


def test_custom_data_reaches_every_strategy_as_the_user_made_it():
    """The DataLoader strategies collate the user's samples; the one-block ones hold the same values
    in one block of the samples' dtype, read once, with int64 labels."""
    j = job(*POINTS, "+dataset.n=20", "+dataset.side=3", "loader.shuffle=false", "loader=pinned_gather")
    dataset = build_dataset(j.dataset)
    assert j.dataset.kwargs == {"n": 20, "side": 3}  # the keys added with + are the callable's arguments
    assert (len(dataset), dataset.sample_shape, dataset.storage_dtype) == (20, (3, 3), torch.float32)
    samples = [dataset.per_sample()[i] for i in range(20)]
    with build_loader(j.loader, dataset, torch.device("cpu")) as loader:
        assert torch.equal(loader.x, torch.stack([torch.from_numpy(x) for x, _ in samples]))
        assert loader.y.dtype == torch.int64 and loader.y.tolist() == [y for _, y in samples]


def test_a_section_read_unvalidated_folds_its_added_keys_too():
    """A composed (or saved) section, built without `validate`, gives its added keys to the callable too."""
    section = compose_config(*POINTS, "+dataset.n=20").dataset
    assert DATASETS.config(section).kwargs == {"n": 20} and len(build_dataset(section)) == 20


def test_only_the_one_block_strategies_check_that_the_data_fits_in_host_memory(monkeypatch):
    """The DataLoader strategies read each sample when asked: a dataset larger than the host's memory
    is theirs to iterate; a strategy that holds it in one block refuses it before reading it."""
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2**20)
    overrides = [*POINTS, "+dataset.n=1000", "+dataset.side=32"]  # 4 MB of samples
    with build_loader(job(*overrides).loader, build_dataset(job(*overrides).dataset), torch.device("cpu")) as loader:
        assert len(next(iter(loader))[0]) == 8
    j = job(*overrides, "loader=pinned_gather")
    with pytest.raises(ConfigError, match=r"^loader=pinned_gather \(the whole dataset in host memory .*\) needs 0.00 GiB "
                                          r"of host memory but only 0.00 GiB is available"):
        build_loader(j.loader, build_dataset(j.dataset), torch.device("cpu"))


def test_custom_data_without_labels_is_class_zero_everywhere():
    found = {s: checksums(s, *POINTS, "+dataset.labels=false", "loader.shuffle=false") for s in ("baseline", "pinned_gather")}
    assert found["baseline"] == found["pinned_gather"]
    j = job(*POINTS, "+dataset.labels=false")
    with build_loader(j.loader, build_dataset(j.dataset), torch.device("cpu")) as loader:
        assert all(torch.equal(y, torch.zeros(len(x), dtype=torch.int64)) for x, y in loader)


def test_a_custom_dataset_and_model_train_alike_through_two_strategies_in_bf16(runs, tracking_uri):
    """Shuffled, the same batches reach the model in the same order: the same losses, step by step,
    from pageable batches (baseline) and from one pinned block (pinned_gather), in bf16 on the CPU."""
    for strategy in ("baseline", "pinned_gather"):
        run(compose_config(*QUICK, *POINTS, "model=custom", f"model._target_={MODULE}.Net", "+model.hidden=32",
                           f"loader={strategy}", "engine.max_steps=12", "engine.precision=bf16",
                           "engine.optimizer.lr=0.05", f"tracking.uri={tracking_uri}"))
    done = {r.data.tags["strategy"]: r for r in runs()}
    for r in done.values():
        assert r.info.status == "FINISHED"
        assert (r.data.tags["dataset"], r.data.tags["model"], r.data.tags["precision"]) == ("custom", "custom", "bf16")
        assert r.data.params["model.kwargs.hidden"] == "32"  # the keys added with + are logged as the others
    losses = {s: [float(row["loss"]) for row in steps_csv(tracking_uri, r.info.run_id)] for s, r in done.items()}
    assert len(losses["baseline"]) == 12 and losses["baseline"] == losses["pinned_gather"]
    assert losses["baseline"][-1] < losses["baseline"][0]  # it learns


# -- your model --------------------------------------------------------------------------------------
def custom_model(*overrides: str, shape=(4, 4), classes=3):
    return build_model(job("model=custom", f"model._target_={MODULE}.Net", *overrides).model, shape, classes)


LABELS = torch.tensor([0, 2, 1, 1, 0])


@pytest.mark.parametrize("target,loss,y,expected", [
    ("Net", "cross_entropy", LABELS, lambda m, x, y: F.cross_entropy(m(x), y)),
    ("AutoEncoder", "mse", LABELS, lambda m, x, y: F.mse_loss(m(x), x)),
    ("OwnLoss", "none", LABELS, lambda m, x, y: F.cross_entropy(m.net(x), y) + 1.0),
    ("Net", f"{MODULE}.l1", LABELS, lambda m, x, y: (m(x) - F.one_hot(y, 3).float()).abs().mean()),
    ("Net", "torch.nn.SmoothL1Loss", torch.rand(5, 3), lambda m, x, y: F.smooth_l1_loss(m(x), y)),
])
def test_model_loss_names_what_the_output_meets(target, loss, y, expected):
    model = custom_model(f"model._target_={MODULE}.{target}", f"model.loss={loss}")
    x = torch.rand(5, 4, 4)
    assert torch.equal(model.loss(x, y), expected(model.module, x, y))


def test_torchvision_model_takes_the_datasets_channels_and_classes():
    j = job("model=torchvision", "model.arch=resnet18")
    model = build_model(j.model, (1, 28, 28), 7)
    assert model.module.conv1.in_channels == 1 and model.module.fc.out_features == 7
    assert model.module(torch.rand(2, 1, 28, 28)).shape == (2, 7)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # initialised here: nothing downloaded


def test_torchvision_resnet18_runs_on_cifar_shaped_data(runs, tracking_uri):
    summary = run(compose_config(*QUICK, "dataset.shape=[3,32,32]", "dataset.dtype=uint8", "dataset.num_samples=12",
                                 "loader.batch_size=4", "engine.max_steps=3", "model=torchvision", "model.arch=resnet18",
                                 f"tracking.uri={tracking_uri}"))
    (r,) = runs()
    assert r.info.status == "FINISHED" and r.data.tags["model"] == "torchvision"
    assert summary["timed_steps"] == 2 and np.isfinite(summary["final_loss"])


# -- images from disk --------------------------------------------------------------------------------
def test_image_folder_decodes_and_resizes_each_image_once_per_path(tmp_path):
    paths = write_images(tmp_path / "images")
    folder = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16"]
    dataset = build_dataset(job(*folder).dataset)
    assert (len(dataset), dataset.num_classes, dataset.sample_shape, dataset.storage_dtype) == (6, 2, (3, 16, 16), torch.uint8)
    for i, path in enumerate(paths):  # what PIL gives, resized, as floats in [0, 1], in the DataLoader's view
        expected = torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((16, 16), Image.BILINEAR)))
        x, y = dataset.per_sample()[i]
        assert x.dtype == torch.float32 and torch.equal((x * 255).round().to(torch.uint8), expected.permute(2, 0, 1))
        assert y == (0 if path.parent.name == "cats" else 1)
    with build_loader(job(*folder, "loader=pinned_gather").loader, dataset, torch.device("cpu")) as loader:
        assert loader.x.dtype == torch.uint8  # kept as bytes in the block, made float after the copy
    found = {s: checksums(s, *folder, "loader.batch_size=4", "loader.shuffle=false") for s in STRATEGIES}
    assert len(set(found.values())) == 1, found


def test_image_folder_trains_with_loader_workers_decoding(tmp_path, runs, tracking_uri):
    write_images(tmp_path / "images")
    summary = run(compose_config(*QUICK, "dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16",
                                 "loader.batch_size=2", "loader.num_workers=2", "model=mlp", "engine.max_steps=4",
                                 f"tracking.uri={tracking_uri}"))
    (r,) = runs()
    assert r.info.status == "FINISHED" and r.data.tags["dataset"] == "image_folder"
    assert summary["timed_steps"] == 3


# -- precision ---------------------------------------------------------------------------------------
class Recorded(nn.Module):
    """A linear model that records the dtype its layer computed in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.computed_in = []

    def loss(self, x, y):
        out = self.lin(x)
        self.computed_in.append(out.dtype)
        return out.float().sum() * y


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_precision_runs_forward_in_autocast_and_keeps_float32_weights(precision, dtype):
    torch.manual_seed(0)
    model = Recorded()
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.1), graphed=False, precision=precision)
    before = model.lin.weight.detach().clone()
    step(torch.rand(8, 4), 1e-3)  # gradients well within float16's range once scaled
    assert model.computed_in == [dtype] and model.lin.weight.dtype == torch.float32
    assert not torch.equal(model.lin.weight, before)  # a step was taken
    assert (step.scaler is not None) == (precision == "fp16")


def test_fp16_scaler_skips_a_step_whose_gradients_overflow():
    model = Recorded()
    step = EagerStep(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
    scale = step.scaler.get_scale()
    before = model.lin.weight.detach().clone()
    step(torch.rand(8, 4), 1e5)  # scaled gradients beyond float16's range
    assert torch.equal(model.lin.weight, before) and step.scaler.get_scale() == scale / 2


def test_precision_is_checked_and_fp16_is_refused_with_cuda_graphs():
    with pytest.raises(ConfigError, match=r"^engine.precision must be one of fp32, bf16, fp16 \(got 'fp8'\): set engine.precision=fp32$"):
        job("engine.precision=fp8")
    with pytest.raises(ConfigError, match=r"^engine.precision=fp16 cannot be used with engine.cuda_graph=true .*: set "
                                          r"engine.precision=bf16 \(no scaler\), or engine.cuda_graph=false$"):
        job("engine.precision=fp16", "engine.cuda_graph=true")
    with pytest.raises(ConfigError, match="engine.precision=fp16 cannot be used with engine.cuda_graph=true"):
        GraphedStep(Recorded(), None, precision="fp16")


def test_the_plain_loop_reference_runs_the_engines_step_in_the_runs_precision(monkeypatch):
    made = []
    monkeypatch.setattr(plain_loop, "make_step", lambda *args, **kw: made.append(args[3]) or make_step(*args, **kw))
    cfg = ["dataset.num_samples=32", "dataset.shape=[4,4]", "engine.max_steps=3", *QUICK, "engine.precision=bf16"]
    assert plain_loop.measure(compose_config(*cfg))["plain_timed_steps"] == 2 and made == ["bf16"]
    with pytest.raises(ConfigError, match=r"^the hand-written step runs in fp32 \(got engine.precision=bf16\): use the "
                                          r"engine's step \(--step engine\)"):
        plain_loop.measure(compose_config(*cfg), step="hand")


@pytest.mark.parametrize("loop", ["feedbench", "lightning"])
def test_fp16_is_refused_on_the_cpu_where_it_runs_many_times_slower(tracking_uri, runs, loop):
    """On the CPU PyTorch has no fast float16 kernels (a step ~8x slower than fp32), and Lightning
    would run bf16 in its place: either loop refuses it before the run, naming the fix."""
    if loop == "lightning":
        pytest.importorskip("lightning")
    with pytest.raises(ConfigError, match=r"^engine.precision=fp16 needs a GPU: on the CPU .* several times slower than "
                                          r"in fp32.*: set engine.precision=bf16 \(mixed precision on a CPU\) or "
                                          r"engine.precision=fp32$"):
        run(compose_config(*QUICK, f"engine.loop={loop}", "engine.precision=fp16", "dataset.num_samples=32",
                           "dataset.shape=[4,4]", f"tracking.uri={tracking_uri}"))
    assert runs() == []  # refused before a run was opened


@gpu
def test_a_graphed_bf16_step_trains_as_the_eager_one():
    """The autocast region captured inside the graph: the same losses as eager bf16 steps."""
    device = torch.device("cuda")
    losses = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = custom_model().to(device)
        step = make_step(model, torch.optim.Adam(model.parameters(), lr=1e-2, capturable=graphed), graphed, "bf16")
        g = torch.Generator().manual_seed(1)
        # One batch, six steps: its loss must fall (over six different random batches it need not).
        x, y = torch.rand(8, 4, 4, generator=g).to(device), torch.randint(0, 3, (8,), generator=g).to(device)
        losses[graphed] = [float(step(x, y)) for _ in range(6)]
        assert step.graph_replays == 6 * graphed
    # bf16 rounds differently in and out of a graph (autocast's cast cache is off in a capture): the
    # first step agrees closely, the six together within what bf16's 8-bit mantissa lets training drift.
    assert losses[True][0] == pytest.approx(losses[False][0], rel=1e-2)
    assert losses[True] == pytest.approx(losses[False], rel=5e-2)
    assert losses[True][-1] < losses[True][0]


# -- bad input: one line naming the key and the fix --------------------------------------------------
@pytest.mark.parametrize("target,message", [
    ("", r"^dataset._target_ is not set: set dataset._target_=<module>.<callable>"),
    ("make", r"^dataset._target_='make' is not an import path: set dataset._target_=<module>.<name>"),
    ("no_such_module_here.make", r"^dataset._target_=no_such_module_here.make: no module no_such_module_here can be "
                                 r"imported: put the folder that holds no_such_module_here.py on PYTHONPATH"),
    (f"{MODULE}.nope", rf"^dataset._target_={MODULE}.nope: module {MODULE} has no nope: fix the name"),
    (f"{MODULE}.NOT_CALLABLE", rf"^dataset._target_={MODULE}.NOT_CALLABLE is a int, not a callable"),
    (f"{MODULE}.not_a_dataset", rf"^dataset._target_={MODULE}.not_a_dataset returned a builtins.int, not a dataset: "
                                r"return a map-style torch.utils.data.Dataset"),
    (f"{MODULE}.Stream", rf"^dataset._target_={MODULE}.Stream returned an IterableDataset, .*: return a map-style"),
])
def test_a_dataset_target_that_cannot_make_a_dataset_is_one_line(target, message):
    with pytest.raises(ConfigError, match=message):
        build_dataset(job("dataset=custom", f"dataset._target_={target}").dataset)


def test_the_callables_own_failure_names_its_arguments():
    with pytest.raises(ConfigError, match=rf"^dataset._target_={MODULE}.points raised TypeError when called with "
                                          r"bogus=1: .*unexpected keyword argument 'bogus': fix its keyword arguments "
                                          r"\(\+dataset.<name>=<value>\)"):
        build_dataset(job(*POINTS, "+dataset.bogus=1").dataset)


def test_an_unknown_key_is_still_refused_in_the_other_sections():
    with pytest.raises(ConfigError, match=r"^loader.root is not a key of loader"):
        job(*POINTS, "+loader.root=/data")
    with pytest.raises(ConfigError, match=r"^dataset.root is not a key of dataset"):
        job("+dataset.root=/data")  # dataset=synthetic takes no keyword arguments


@pytest.mark.parametrize("strategy,readers", [(s, 0) for s in ONE_BLOCK] + [("pinned_gather", 2)])
def test_samples_of_another_shape_are_refused_by_the_one_block_strategies(strategy, readers):
    """Read in this process or by reading workers, the refusal is the same one line."""
    j = job(*POINTS, "+dataset.ragged_at=29", f"loader={strategy}", f"dataset.read_workers={readers}")
    with pytest.raises(ConfigError, match=rf"^dataset._target_={MODULE}.points: sample 29's x is \[5, 5\] float32 but "
                                          r"sample 0's is \[4, 4\] float32, and loader=pinned_chunk, pinned_gather, "
                                          r"pinned_uva and gpu_resident hold the data in one block.*: make the samples "
                                          r"one shape and dtype"):
        build_loader(j.loader, build_dataset(j.dataset), torch.device("cpu"))


def test_labels_that_are_not_class_numbers_are_refused_by_the_one_block_strategies():
    j = job("dataset=custom", f"dataset._target_={MODULE}.float_labels", "loader=gpu_resident")
    with pytest.raises(ConfigError, match=r"its y is \[44\] float32, and .* one int64 class number per sample: use "
                                          r"loader=baseline, pinned or prefetch"):
        build_loader(j.loader, build_dataset(j.dataset), torch.device("cpu"))
    assert checksums("baseline", "dataset=custom", f"dataset._target_={MODULE}.float_labels")[2] == 12  # as they come


@pytest.mark.parametrize("overrides,message", [
    ([f"model._target_={MODULE}.not_a_module"], rf"^model._target_={MODULE}.not_a_module returned a builtins.str, not "
                                                r"a torch.nn.Module"),
    (["model.loss=l2"], r"^model.loss must be one of cross_entropy, mse, none or the import path of a loss\(output, y\) "
                        r"\(got 'l2'\): set model.loss=cross_entropy$"),
    (["model.loss=torch.nn.nothing"], r"^model.loss=torch.nn.nothing: module torch.nn has no nothing"),
])
def test_a_model_target_or_loss_that_cannot_be_made_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        custom_model(*overrides)


@pytest.mark.parametrize("overrides,message", [
    (["model.loss=mse"], rf"^model.loss=mse compares the output with the input x \[1, 4, 4\], and model._target_="
                         rf"{MODULE}.Net returns \[1, 3\]: return an output shaped like x, or set model.loss=cross_entropy$"),
    ([f"model._target_={MODULE}.AutoEncoder"], r"^model.loss=cross_entropy takes class scores \[batch, classes\], and "
                                               r".* returns \[1, 4, 4\] for a batch of 1: return \[batch, classes\] "
                                               r"scores, or set model.loss=mse"),
    (["dataset.num_classes=5"], r"returns 3 class scores, and the dataset has 5 classes: return at least 5 scores"),
    (["+model.side=5"], rf"^model._target_={MODULE}.Net with model.loss=cross_entropy fails on one sample of the "
                        r"dataset \(x \[1, 4, 4\]\): RuntimeError: .*: make the module take the dataset's samples"),
    (["+dataset.labels=false"], r"^model.loss=cross_entropy needs labels, and the dataset's samples have none: set "
                                r"model.loss=mse"),
])
def test_a_model_whose_output_does_not_fit_its_loss_is_refused_on_one_sample(overrides, message):
    j = job(*POINTS, "model=custom", f"model._target_={MODULE}.Net", *overrides)
    data = build_dataset(j.dataset)
    model = build_model(j.model, data.sample_shape, data.num_classes)
    with pytest.raises(ConfigError, match=message):
        model.check(*data.example(torch.device("cpu")))


def test_a_torchvision_model_needs_a_known_arch_and_images():
    with pytest.raises(ConfigError, match=r"^model.arch must be a classification model of torchvision.models \(got "
                                          r"'resnet1'\): set model.arch=resnet18"):
        job("model=torchvision", "model.arch=resnet1")
    with pytest.raises(ConfigError, match=r"^model=torchvision takes images, .* \(got samples of shape \[8, 8\]\)"):
        build_model(job("model=torchvision").model, (8, 8), 10)


@pytest.mark.parametrize("strategy, workers, failed_step", [("baseline", 0, "3"), ("baseline", 2, "3"),
                                                            ("gpu_resident", 0, None)])
def test_a_sample_that_raises_is_named_in_one_line_with_the_step_it_stopped(strategy, workers, failed_step,
                                                                             runs, tracking_uri):
    """The dataset's own code fails on sample 20 (the third batch of 8, unshuffled): in the run's
    process, in a DataLoader worker, or while a one-block strategy reads the data before the loop."""
    with pytest.raises(RunFailed) as failed:
        run(compose_config(*QUICK, *POINTS, "+dataset.broken_at=20", f"loader={strategy}", "loader.shuffle=false",
                           f"loader.num_workers={workers}", "model=custom", f"model._target_={MODULE}.Net",
                           "engine.max_steps=5", f"tracking.uri={tracking_uri}"))
    assert str(failed.value) == (f"dataset._target_={MODULE}.points: sample 20 raised RuntimeError: disk on fire: "
                                 f"fix that sample, or leave it out of the dataset")
    (r,) = runs()
    assert r.info.status == "FAILED" and r.data.tags.get("failed_step") == failed_step
    assert r.data.metrics.get("total_steps") == (2 if failed_step else None)  # the two steps before it are kept


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_of_another_shape_is_named_in_one_line_with_the_step_it_stopped(workers, runs, tracking_uri):
    """Sample 20 (the third batch of 8, unshuffled) is 5 x 5 where sample 0 is 4 x 4: the DataLoader
    could not stack its batch; the run names the sample, not the collate's trace."""
    with pytest.raises(RunFailed) as failed:
        run(compose_config(*QUICK, *POINTS, "+dataset.ragged_at=20", "loader=baseline", "loader.shuffle=false",
                           f"loader.num_workers={workers}", "engine.max_steps=5", f"tracking.uri={tracking_uri}"))
    assert str(failed.value) == (f"dataset._target_={MODULE}.points: sample 20's x has shape [5, 5] but sample 0's "
                                 f"has [4, 4], and a batch stacks its samples into one tensor: make every sample one "
                                 f"shape (resize or pad it in __getitem__)")
    (r,) = runs()
    assert r.info.status == "FAILED" and r.data.tags["failed_step"] == "3" and r.data.metrics["total_steps"] == 2


def test_a_first_sample_that_raises_is_one_line_and_a_failed_run(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *QUICK, *POINTS, "+dataset.broken_at=0", "loader=baseline")
    (line,) = proc.stderr.strip().splitlines()
    (r,) = all_runs(tracking_uri)
    assert proc.returncode == 1 and line == (f"error: dataset._target_={MODULE}.points: sample 0 raised RuntimeError: "
                                             f"disk on fire: fix that sample, or leave it out of the dataset (run "
                                             f"{r.info.run_id} marked FAILED)")
    assert r.info.status == "FAILED" and "failed_step" not in r.data.tags  # before its first step


def test_a_folder_of_files_that_are_not_images_is_one_line(tmp_path, runs, tracking_uri):
    for i in range(4):
        (tmp_path / "images" / "cats").mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / "cats" / f"{i}.jpg").write_text("not a JPEG")
    with pytest.raises(RunFailed, match=rf"^dataset=image_folder \(dataset.root={tmp_path / 'images'}\): sample 0 "
                                        rf"\({tmp_path / 'images' / 'cats' / '0.jpg'}\) raised UnidentifiedImageError: "
                                        r"cannot identify image file .*: replace or remove that file$"):
        run(compose_config(*QUICK, "dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=8",
                           "loader=baseline", "loader.batch_size=2", f"tracking.uri={tracking_uri}"))
    assert runs()[0].info.status == "FAILED"


def test_an_image_that_does_not_decode_is_named_in_one_line(tmp_path, tracking_uri):
    paths = write_images(tmp_path / "images")
    broken = paths[0].with_name("broken.jpg")
    broken.write_bytes(b"not a JPEG" * 10)
    proc = run_cli(tmp_path, tracking_uri, *QUICK, "dataset=image_folder", f"dataset.root={tmp_path / 'images'}",
                   "dataset.size=16", "loader=gpu_resident", "loader.batch_size=2", "engine.max_steps=2")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    index = sorted([*paths, broken], key=lambda p: (p.parent.name, p.name)).index(broken)
    assert line.startswith(f"error: dataset=image_folder (dataset.root={tmp_path / 'images'}): sample {index} "
                           f"({broken}) raised UnidentifiedImageError: cannot identify image file")
    assert line.endswith(": replace or remove that file (run " + line.split("(run ")[-1])


def test_a_folder_without_images_is_one_line(tmp_path):
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "notes.txt").write_text("no image here")
    with pytest.raises(ConfigError, match=rf"^dataset.root={tmp_path} holds no images \(.*\): set dataset.root to a "
                                          r"folder of class subfolders holding JPEG or PNG files"):
        build_dataset(job("dataset=image_folder", f"dataset.root={tmp_path}").dataset)
    with pytest.raises(ConfigError, match=r"^dataset.root is not set: set dataset.root=/path/to/images"):
        build_dataset(job("dataset=image_folder").dataset)


# -- the command line, as the README and docs/own_training.md show it ----------------------------------------------
def doc_example():
    """The user module and the command of the README's "Measure your own training"; docs/own_training.md
    shows the same command."""
    text = (PROJECT_ROOT / "README.md").read_text()
    module = re.search(r"```python\n# my_training.py\n(.*?)```", text, re.S).group(1)
    command = re.search(r"```bash\n(PYTHONPATH=.*?)```", text, re.S).group(1)
    page = (PROJECT_ROOT / "docs" / "own_training.md").read_text()
    assert re.search(r"```bash\n(PYTHONPATH=.*?)```", page, re.S).group(1) == command
    return module, " ".join(command.replace("\\\n", " ").split())


def test_the_documented_example_runs_with_two_strategies(tmp_path, tracking_uri):
    module, command = doc_example()
    assert len(module.strip().splitlines()) <= 20
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "my_training.py").write_text(module)
    words = command.split()
    assert words[:4] == ["PYTHONPATH=$HOME/code", "python", "-m", "trainer"]
    small = ["+dataset.n=64", "engine.max_steps=6", "engine.warmup_steps=1", "engine.device=cpu", "engine.progress=false"]
    kept = [w for w in words[4:] if w.split("=")[0] not in {s.split("=")[0] for s in small}]
    proc = run_cli(tmp_path, tracking_uri, *kept, *small, env={"PYTHONPATH": f"{tmp_path / 'code'}:{PROJECT_ROOT}"})
    assert proc.returncode == 0, proc.stderr
    jobs = {r.data.tags["strategy"]: r for r in all_runs(tracking_uri) if r.data.tags.get("sweep") != "true"}
    assert sorted(jobs) == ["baseline", "pinned_gather"] and all(r.info.status == "FINISHED" for r in jobs.values())
    assert {(r.data.tags["dataset"], r.data.tags["model"], r.data.tags["precision"]) for r in jobs.values()} == \
        {("custom", "custom", "bf16")}


def test_a_model_that_does_not_fit_stops_the_run_before_its_first_step(runs, tracking_uri):
    with pytest.raises(ConfigError, match=r"^model.loss=mse compares the output with the input x \[1, 4, 4\]"):
        run(compose_config(*QUICK, *POINTS, "model=custom", f"model._target_={MODULE}.Net", "model.loss=mse",
                           f"tracking.uri={tracking_uri}"))
    (r,) = runs()
    assert r.info.status == "FAILED" and "timed_steps" not in r.data.metrics
